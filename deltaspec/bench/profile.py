"""`deltaspec bench profile`: where the time of decode steps goes, kernel by kernel.

C streams (random prompts of `context` tokens) prefill and start decoding; then `steps` engine steps
run under torch's profiler. The report lists the kernels (on CUDA; torch ops on the CPU) by their
own time summed over the profiled steps: calls, total ms, microseconds per step, and share of the
profiled device time — the profile that says what limits a step. Before the profiled steps, as many
steps run unprofiled (`step_ms`: wall time per engine step); with CUDA graphs, `graph_replay_ms` is
one replay of the step's graph back to back with no host work in between (padding inputs), so
`step_ms - graph_replay_ms` is what the host adds to a step. Profiling slows the host, so the
profiled wall time is not a benchmark; `bench decode` and `bench concurrency` are.
"""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from deltaspec.bench.device import bench_engine, identity, random_prompt, say, start, sync
from deltaspec.config.engine import EngineConfig

WARMUP_STEPS = 3


def own_time_us(event, on_device: bool) -> float:
    """An averaged profiler event's own time in microseconds, on the device or the CPU."""
    if on_device:
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return event.self_cpu_time_total


def bench_profile(config: EngineConfig, streams: int, context: int, steps: int, top: int) -> dict:
    prefill_steps = (
        -(-streams * context // config.scheduler.max_num_batched_tokens) + 1
    )  # the first streams decode meanwhile
    max_tokens = prefill_steps + WARMUP_STEPS + 2 * steps + 1  # no stream finishes inside the measured steps
    engine = bench_engine(config, context + max_tokens + 1, streams=streams)
    seqs = start(engine, [random_prompt(engine, context, 7000 + i) for i in range(streams)], max_tokens)
    while any(not s.output_ids for s in seqs):  # prefill until every stream has its first token
        engine.step()
    for _ in range(WARMUP_STEPS):  # graphs captured, kernels compiled
        engine.step()
    sync(engine.device)
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    step_ms = 1000 * (time.perf_counter() - began) / steps
    graphs = engine.runner.graphs
    if engine.config.parallel.tensor_parallel_size > 1:
        graphs = None  # a replay outside a step would wait for the other ranks' collectives
    replay_ms = graphs.time_replays(next(b for b in graphs.batch_sizes if b >= streams), 1) if graphs else None
    on_device = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    say(f"profiling {steps} decode steps of {streams} stream(s) ...")
    sync(engine.device)
    began = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    wall_ms = 1000 * (time.perf_counter() - began) / steps
    if any(s.finished for s in seqs):
        raise RuntimeError(
            f"a stream finished inside the profiled steps; the profile would not be of {streams} streams"
        )
    while engine.has_unfinished():
        engine.step()
    events = [(e.key, e.count, own_time_us(e, on_device)) for e in prof.key_averages()]
    events = sorted((e for e in events if e[2] > 0), key=lambda e: -e[2])
    total_us = sum(us for _, _, us in events)
    kernels = [
        {"name": name, "calls": count, "total_ms": us / 1000, "us_per_step": us / steps, "share": us / total_us}
        for name, count, us in events[:top]
    ]
    return identity(
        engine,
        "profile",
        streams=streams,
        context=context,
        steps=steps,
        time_kind="device" if on_device else "cpu",
        step_ms=step_ms,
        graph_replay_ms=replay_ms,
        profiled_ms_per_step=total_us / 1000 / steps,
        wall_ms_per_step_under_profiler=wall_ms,
        kernels=kernels,
    )
