"""What every device benchmark records and shares: the device's name, a host/device sync, the measured
copy bandwidth, an engine sized for the benchmark, and the loop that drives it (add_request + step).

Benchmarks drive `deltaspec.engine.engine.Engine` directly (no HTTP server), so this module must not
import `deltaspec.server` (the GPU machine has no FastAPI).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import torch

from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError
from deltaspec.execution.sequence import Sequence
from deltaspec.ops.quant.weight import block_types
from deltaspec.provenance import commit
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.speculator import DraftLength

COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # large enough to leave every cache
_ids = itertools.count()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 7) -> float:
    """Median bandwidth in bytes/s of `dst.copy_(src)` over a buffer of `nbytes`: (read + write) / time."""
    nbytes = nbytes or COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in both buffers
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * (nbytes // 4) * 4 / statistics.median(times)


def bench_engine(
    config: EngineConfig,
    longest: int,
    streams: int = 1,
    drafter: Drafter | None = None,
    draft_policy: DraftLength | None = None,
    **changes,
) -> Engine:
    """An engine whose context fits `longest` tokens per sequence and `streams` sequences at once (drafting with
    `drafter` and `draft_policy` when given)."""
    config = config.with_settings(max_model_len=longest, max_num_seqs=max(streams, 1), **changes)
    limit = plan_for(config.with_settings(allow_long_max_model_len=True), drafter).model_config.max_position_embeddings
    if longest > limit:
        raise DeltaspecError(
            f"A context of {longest} tokens exceeds the model's {limit} positions; "
            f"use a shorter --context / --lengths or fewer --max-tokens."
        )
    say(
        f"building the engine ({config.load.shape or config.load.model or 'embedded default model'}, "
        f"{'random weights' if config.load.random_weights else 'checkpoint'}) ..."
    )
    return Engine(config, progress=True, drafter=drafter, draft_policy=draft_policy)


def random_prompt(engine: Engine, length: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from the vocabulary (seeded; prompts differ per seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.model_config.vocab_size, (length,), generator=gen).tolist()


def start(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[Sequence]:
    """Add one greedy request (eos ignored, exactly `max_tokens` new tokens) per prompt."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [engine.add_request(f"bench-{next(_ids)}", None, p, params) for p in prompts]


def drive(engine: Engine, seqs: list[Sequence]) -> list[Sequence]:
    """Step the engine until every request has finished; a failed request is an error."""
    while engine.has_unfinished():
        engine.step()
    if failed := [s for s in seqs if s.finish_reason == "error"]:
        raise DeltaspecError(f"A benchmark request failed: {failed[0].error}")
    return seqs


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[Sequence]:
    """Run greedy requests for all `prompts` together until they finish."""
    return drive(engine, start(engine, prompts, max_tokens))


def identity(engine: Engine, benchmark: str, **extra) -> dict:
    """The fields every report starts with, read from what ran: benchmark, device, dtype, model or shape, the
    drafter (the engine's resolved `speculative`: an injected drafter's name) and its draft length, commit."""
    cfg = engine.config
    source = (
        {"shape": cfg.load.shape, "random_weights": True}
        if cfg.load.random_weights
        else {"model": str(engine.model_dir)}
    )
    return {
        "benchmark": benchmark,
        "device": device_name(engine.device),
        "dtype": cfg.load.dtype,
        "state_dtype": cfg.cache.state_dtype,
        "kv_cache_dtype": cfg.cache.kv_cache_dtype,
        **source,
        "quant": cfg.load.quant,
        "weight_blocks": block_types(engine.model),  # GGUF types of the weights kept quantized; [] for float
        "repack_s": engine.model.repack_seconds,  # --repack: seconds the load spent repacking; None: not repacked
        "fp8_activations": cfg.load.fp8_activations,  # dynamic: FP8 products of over 64 rows quantize activations
        "tensor_parallel_size": cfg.parallel.tensor_parallel_size,  # ranks (GPUs); bytes and rooflines are one rank's
        "expert_parallel": cfg.parallel.enable_expert_parallel,  # routed experts split whole among the ranks
        "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,  # stages; bytes and rooflines are rank 0's
        "pipeline_micro_batches": cfg.parallel.pipeline_micro_batches,  # a step's sequences cut into at most these
        "speculative": cfg.speculation.speculative,
        "draft_tokens": cfg.speculation.draft_tokens if cfg.speculation.speculative != "none" else None,
        "dependent_launch": dependent_launch(engine.device),  # Triton kernels with programmatic dependent launch
        "commit": commit(),
        **extra,
    }


def dependent_launch(device: torch.device) -> bool:
    """Whether the engine's Triton kernels launch with programmatic dependent launch (`ops.triton.pdl`)."""
    if torch.device(device).type != "cuda":
        return False
    from deltaspec.ops.triton import pdl

    return bool(pdl.ENABLED)
