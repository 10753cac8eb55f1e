"""`deltaspec bench concurrency`: C streams of the same context and length decoding together.

For each C, C requests (distinct random prompts of `context` tokens, `max_tokens` new tokens each, eos
ignored) start at once and run to the end. Per request TPOT = (t_total - t_first) / (n - 1); aggregate
tok/s = C x 1000 / mean TPOT(ms) (DESIGN §6), median over runs, and its ratio to C = 1. Each level's
roofline: a step of C streams reads the weights once (for MoE, the distinct experts per layer an untimed run of
C fresh prompts read per step), and each stream's KV and GDN state; roofline aggregate tok/s = C x measured
copy bandwidth / those bytes, and beside it the same at the device's fixed reference bandwidth
(`deltaspec.bench.reference`).

With pipeline stages (`-pp`), each level also reports every rank's time over its timed runs (prefill and decode
steps alike) in pipelined passes and, of that, waiting on other stages (for a micro-batch's activations or for the
step's results): `stage_wait`, one entry per rank with its `bubble` = waited / pass time. On the CPU (gloo) a wait
blocks the process, so this is the bubble; with NCCL on GPUs the host does not wait there and the figure reads ~0.
"""

from __future__ import annotations

import statistics

from deltaspec.bench.decode import WARMUP_SEED
from deltaspec.bench.device import bench_engine, copy_bandwidth, device_name, identity, random_prompt, run, say
from deltaspec.bench.reference import reference_for, reference_roofline
from deltaspec.bench.roofline import bytes_per_step, experts_per_step
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine


def level_run(engine: Engine, streams: int, context: int, max_tokens: int, seed: int) -> dict:
    prompts = [random_prompt(engine, context, seed * 1000 + i) for i in range(streams)]
    seqs = run(engine, prompts, max_tokens)
    tpot_ms = [1000 * s.metrics()["time_per_output_token"] for s in seqs]
    mean = statistics.fmean(tpot_ms)
    return {"tpot_ms_mean": mean, "tpot_ms_max": max(tpot_ms), "aggregate_tok_s": streams * 1000 / mean}


def stage_wait(engine: Engine, before: list[tuple[int, float, float]]) -> list[dict]:
    """Per rank, its seconds of pipelined passes and of waiting on other stages since the timings `before`
    (`Leader.stage_timings`)."""
    now = engine.executor.stage_timings()
    rows = []
    for rank, ((stage, waited, passes), (_, waited_before, passes_before)) in enumerate(zip(now, before)):
        waited, passes = waited - waited_before, passes - passes_before
        rows.append({"rank": rank, "stage": stage, "pass_s": passes, "waited_s": waited, "bubble": waited / passes})
    return rows


def bench_concurrency(config: EngineConfig, levels: list[int], context: int, max_tokens: int, runs: int) -> dict:
    engine = bench_engine(config, context + max_tokens, streams=max(levels))
    say("measuring copy bandwidth ...")
    bandwidth = copy_bandwidth(engine.device)
    reference = reference_for(device_name(engine.device))
    rows = []
    for c in levels:
        level_run(engine, c, context, min(max_tokens, 4), WARMUP_SEED)
        staged = engine.config.parallel.pipeline_parallel_size > 1
        before = engine.executor.stage_timings() if staged else None
        per_run = [level_run(engine, c, context, max_tokens, seed=i) for i in range(runs)]
        waits = {"stage_wait": stage_wait(engine, before)} if staged else {}
        aggregate = statistics.median(r["aggregate_tok_s"] for r in per_run)
        prompts = [random_prompt(engine, context, (runs + 1) * 1000 + i) for i in range(c)]
        experts = experts_per_step(engine, prompts, max_tokens)
        step_bytes = bytes_per_step(engine, context + max_tokens / 2, streams=c, experts=experts)["total"]
        roofline_tok_s = c * bandwidth / step_bytes
        rows.append(
            {
                "concurrency": c,
                "aggregate_tok_s": aggregate,
                "tpot_ms_mean": statistics.median(r["tpot_ms_mean"] for r in per_run),
                "bytes_per_step": step_bytes,
                "moe_experts_per_step": experts,
                "roofline_tok_s": roofline_tok_s,
                "roofline_fraction": aggregate / roofline_tok_s,
                **reference_roofline(aggregate, step_bytes, reference, streams=c),
                **waits,
                "per_run": per_run,
            }
        )
        say(f"C={c:>3}: {aggregate:.1f} tok/s aggregate ({100 * aggregate / roofline_tok_s:.1f} % of roofline)")
        for row in waits.get("stage_wait", ()):
            say(f"       rank {row['rank']} (stage {row['stage']}): waited {100 * row['bubble']:.1f} % of its passes")
    single = next((r["aggregate_tok_s"] for r in rows if r["concurrency"] == 1), None)
    for row in rows:
        row["ratio_to_single_stream"] = row["aggregate_tok_s"] / single if single else None
    return identity(
        engine,
        "concurrency",
        context=context,
        max_tokens=max_tokens,
        runs=runs,
        bandwidth_gb_s=bandwidth / 1e9,
        reference_bandwidth=reference,
        levels=rows,
    )
