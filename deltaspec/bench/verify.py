"""`deltaspec bench verify`: the cost of one pass with r rows for one sequence, r in {1, 2, 4, ..., 64}.

For each r the oracle drafter (`deltaspec.spec.oracle`, all-accept profile) proposes r - 1
tokens every round, so each decode pass of the sequence verifies exactly r rows at about the given
context. Every engine step is timed on its own (the host waits for the sampled tokens, so a step's time
is its device time plus the host's work); a row count's step time is the median over the steps with
that many rows, over all runs. Reported per r: step ms and the ratio to r = 1.
"""

from __future__ import annotations

import statistics
import time

from deltaspec.bench.decode import WARMUP_SEED, oracle_engine
from deltaspec.bench.device import identity, random_prompt, run, say, start
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.spec.oracle import OracleDrafter


def timed_passes(engine: Engine, oracle: OracleDrafter, rows: int, prompt: list[int], rounds: int) -> list[float]:
    """Seconds of each decode pass that verified `rows` rows, over `rounds` rounds of one sequence."""
    max_tokens = rounds * rows + 1
    reference = run(engine, [prompt], max_tokens)[0].output_ids
    seq = start(engine, [prompt], max_tokens)[0]
    oracle.expect(seq.request.request_id, len(prompt), reference, [1.0] * (rows - 1))
    times = []
    while engine.has_unfinished():
        decoding, proposals = seq.decoding, len(oracle.proposed)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        drafted = oracle.proposed[-1] if len(oracle.proposed) > proposals else 0
        if decoding and 1 + drafted == rows:
            times.append(elapsed)
    return times


def bench_verify(config: EngineConfig, context: int, rows: list[int], rounds: int, runs: int) -> dict:
    if not rows or min(rows) < 1:
        raise DeltaspecError(f"Row counts must be at least 1; got {rows}.")
    engine, oracle = oracle_engine(config, context + rounds * max(rows) + 1, max(rows) - 1)
    if max(rows) > engine.config.scheduler.max_num_batched_tokens:
        raise DeltaspecError(
            f"{max(rows)} rows exceed --max-num-batched-tokens {engine.config.scheduler.max_num_batched_tokens}."
        )
    results = []
    for r in rows:
        timed_passes(engine, oracle, r, random_prompt(engine, context, WARMUP_SEED), 1)  # warm-up (graphs, kernels)
        times = [
            t for i in range(runs) for t in timed_passes(engine, oracle, r, random_prompt(engine, context, i), rounds)
        ]
        if not times:
            raise DeltaspecError(f"No pass verified {r} rows; raise --rounds.")
        results.append({"rows": r, "step_ms": 1000 * statistics.median(times), "passes": len(times)})
        say(f"{r:>3} rows: {results[-1]['step_ms']:.2f} ms per pass")
    base = results[0]["step_ms"] if rows[0] == 1 else None
    for row in results:
        row["ratio_to_1_row"] = row["step_ms"] / base if base else None
    return identity(
        engine,
        "verify",
        context=context,
        rounds=rounds,
        runs=runs,
        speculative="oracle all-accept",
        context_end=context + rounds * max(rows) + 1,
        rows=results,
    )
