"""`deltaspec bench profile`: where the time of decode steps goes, kernel by kernel.

C streams (random prompts of `context` tokens) prefill and start decoding; then `steps` engine steps
run under torch's profiler. The report lists the kernels (on CUDA; torch ops on the CPU) by their
own time summed over the profiled steps: calls, total ms, microseconds per step, and share of the
profiled device time — the profile that says what limits a step. Before the profiled steps, as many
steps run unprofiled (`step_ms`: wall time per engine step); with CUDA graphs, `graph_replay_ms` is
one replay of the step's graph back to back with no host work in between (padding inputs), so
`step_ms - graph_replay_ms` is what the host adds to a step. Profiling slows the host, so the
profiled wall time is not a benchmark; `bench decode` and `bench concurrency` are.

Per step the report also gives the kernels launched (on CUDA the device's kernels and copies, in graphs or not;
on the CPU the torch ops that took time), the time of the weight products (`product_ms_per_step`: cuBLAS and
CUTLASS GEMM / GEMV kernels and deltaspec's product kernels — `PRODUCT_MODULES`; on the CPU the matrix-multiply
ops), the rest of the device time (`non_product_ms_per_step`: norms, GDN, attention, routing, copies, ...), and
`host_ms_not_hidden_per_step`: the unprofiled step's wall time minus that device time, what the host adds that
the device does not cover. On CUDA only device events are summed (a CPU op's device time is its kernels', which
are listed themselves).
"""

from __future__ import annotations

import re
import time
from functools import cache

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from deltaspec.bench.device import bench_engine, identity, random_prompt, say, start, sync
from deltaspec.config.engine import EngineConfig

WARMUP_STEPS = 3


# deltaspec's Triton modules whose kernels are the weight products and their helpers (GEMV / GEMM tiles, split-K
# reductions, MoE expert products and their sum, W8A8's activation quantization, prefill's dequantization ahead of
# cuBLAS)
PRODUCT_MODULES = (
    "quant_gemv",
    "quant_gemv_hf",
    "quant_matmul",
    "quant_dequant",
    "skinny_gemm",
    "w8a8",
    "moe.grouped",
    "moe.pairs",
)
LIBRARY_PRODUCTS = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitKreduce", re.IGNORECASE)  # cuBLAS, CUTLASS
CPU_PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm", "aten::linear"})


@cache
def product_kernel_names() -> frozenset[str]:
    """The names of the Triton kernels in `PRODUCT_MODULES` (what the profiler calls them)."""
    import importlib

    names = set()
    for module in PRODUCT_MODULES:
        path = f"deltaspec.ops.triton.{module}"
        for value in vars(importlib.import_module(path)).values():
            fn = value
            while hasattr(fn, "fn"):  # autotune / heuristics wrappers around the JITFunction
                fn = fn.fn
            if fn is not value and getattr(fn, "__module__", None) == path and fn.__name__.endswith("_kernel"):
                names.add(fn.__name__)
    return frozenset(names)


def is_product(name: str, on_device: bool) -> bool:
    """Whether a profiled kernel (or, on the CPU, op) is a weight product."""
    if not on_device:
        return name in CPU_PRODUCTS
    return name in product_kernel_names() or bool(LIBRARY_PRODUCTS.search(name))


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
    if engine.config.parallel.world_size > 1:
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
    wanted = DeviceType.CUDA if on_device else DeviceType.CPU
    events = [(e.key, e.count, own_time_us(e, on_device)) for e in prof.key_averages() if e.device_type == wanted]
    events = sorted((e for e in events if e[2] > 0), key=lambda e: -e[2])
    total_us = sum(us for _, _, us in events)
    product_us = sum(us for name, _, us in events if is_product(name, on_device))
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
        kernels_per_step=sum(count for _, count, _ in events) / steps,
        product_ms_per_step=product_us / 1000 / steps,
        non_product_ms_per_step=(total_us - product_us) / 1000 / steps,
        host_ms_not_hidden_per_step=max(step_ms - total_us / 1000 / steps, 0.0),
        wall_ms_per_step_under_profiler=wall_ms,
        kernels=kernels,
    )
