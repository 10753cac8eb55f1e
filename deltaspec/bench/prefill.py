"""`deltaspec bench prefill`: prompt throughput at several lengths (default 1k, 8k, 32k tokens).

For each length L a fresh random prompt (no prefix to reuse) generates one token; prefill tok/s =
L / time to first token, median over runs after a warm-up. The engine's context fits the longest prompt;
--prefill-chunk and --max-num-batched-tokens set how many prompt rows go into one pass.
"""

from __future__ import annotations

import statistics

from deltaspec.bench.decode import WARMUP_SEED
from deltaspec.bench.device import bench_engine, identity, random_prompt, run, say
from deltaspec.config.engine import EngineConfig


def bench_prefill(config: EngineConfig, lengths: list[int], runs: int) -> dict:
    engine = bench_engine(config, max(lengths) + 1)
    run(engine, [random_prompt(engine, min(lengths), WARMUP_SEED)], 1)
    rows = []
    for length in lengths:
        ttft = [
            run(engine, [random_prompt(engine, length, 7919 * i + length)], 1)[0].metrics()["time_to_first_token"]
            for i in range(runs)
        ]
        rows.append(
            {
                "length": length,
                "ttft_s": statistics.median(ttft),
                "prefill_tok_s": length / statistics.median(ttft),
                "per_run_ttft_s": ttft,
            }
        )
        say(f"{length:>6} tokens: {rows[-1]['prefill_tok_s']:.0f} tok/s")
    return identity(
        engine,
        "prefill",
        runs=runs,
        prefill_chunk=engine.config.scheduler.prefill_chunk,
        max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens,
        lengths=rows,
    )
