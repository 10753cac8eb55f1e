"""What `deltaspec serve` writes to its log besides per-request lines: where log records go, the start-up summary,
and the periodic throughput line.

`startup_summary` describes the engine that was built, with its numbers read from the engine itself (the memory
plan, the caches it allocated, its resolved configuration), never recomputed. `stats_line` is vLLM's periodic
line, from two `StatsSnapshot`s: prompt and generation throughput over the interval, running and waiting
sequences, KV cache usage, and, when samples finished in the interval, the share of their prompt tokens resumed
from prefix checkpoints and their draft acceptance. `log_stats` takes a snapshot every interval and logs the line
when something happened since the last one; it only reads counters the engine and the server keep anyway.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from deltaspec.cache.memory_plan import GIB
from deltaspec.engine.engine import Engine
from deltaspec.model.hf_config import checkpoint_dtype, read_config_json
from deltaspec.ops.quant.weight import block_types
from deltaspec.server.metrics import TokenTally

log = logging.getLogger("deltaspec.server")

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging() -> None:
    """deltaspec's INFO records (start-up summary, throughput, errors) to stderr, unless a handler is set already."""
    root = logging.getLogger("deltaspec")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def memory(size: int) -> str:
    """Bytes in GiB, or in MiB below a hundredth of a GiB."""
    return f"{size / GIB:.2f} GiB" if size >= GIB // 100 else f"{size / (1 << 20):.1f} MiB"


def model_origin(engine: Engine) -> str:
    """Where the served weights came from: a checkpoint directory, a hub id, the embedded model or random weights."""
    config = engine.config
    if config.load.random_weights:
        return f"random weights, shape {config.load.shape}"
    if config.load.model is None:
        return "embedded default model"
    if Path(config.load.model).expanduser().is_dir():
        return f"checkpoint {engine.model_dir}"
    if engine.model_dir is not None and engine.model_dir.suffix == ".gguf":
        return f"GGUF file {engine.model_dir}"
    return f"hub id {config.load.model}, files in {engine.model_dir}"


def weights_format(engine: Engine) -> str:
    """'safetensors <the checkpoint's dtype>', 'GGUF <the block types kept>', or 'random weights'; and whether
    there is a tokenizer."""
    kept = block_types(engine.model)
    if engine.model_dir is None:
        kind = "random weights"
    elif engine.model_dir.suffix == ".gguf":
        kind = f"GGUF, weights kept as {'+'.join(kept)} blocks" if kept else "GGUF, float weights"
    else:
        stored = checkpoint_dtype(read_config_json(engine.model_dir))
        kind = f"safetensors {stored}" if stored else "safetensors"
    return kind if engine.tokenizer is not None else f"{kind}, no tokenizer (token-id prompts on /v1/completions)"


def startup_summary(engine: Engine, model_name: str) -> list[str]:
    """The lines `deltaspec serve` logs once the engine is built."""
    config, plan, cache = engine.config, engine.plan, engine.cache
    pages, block = cache.kv.allocator.num_blocks, config.cache.block_size
    streams, checkpoints = cache.num_slots, len(cache.gdn.checkpoint_slots)
    drafter = "none"
    speculation = config.speculation
    if speculation.speculative != "none":
        drafter = (
            f"{speculation.speculative}, up to {speculation.draft_tokens} draft tokens, {memory(plan.drafter_bytes)}"
        )
    rows = [
        ("model", f"'{model_name}' ({model_origin(engine)})"),
        ("format", weights_format(engine)),
        (
            "device",
            f"{config.host.device}, dtype {config.load.dtype}, GDN state dtype {config.cache.state_dtype}, "
            f"KV cache dtype {config.cache.kv_cache_dtype}",
        ),
        ("weights", memory(plan.weights)),
        ("KV cache", f"{memory(cache.kv.bytes())}, {pages * block} tokens ({pages} pages x {block})"),
        (
            "GDN states",
            f"{memory(cache.gdn.bytes())}, {streams + checkpoints + 1} slots ({streams} streams, "
            f"{checkpoints} prefix checkpoints, 1 scratch)",
        ),
        ("streams", f"{config.scheduler.max_num_seqs} x {config.scheduler.max_model_len} tokens"),
        ("drafter", drafter),
    ]
    width = max(len(name) for name, _ in rows) + 1
    return [f"{name + ':':<{width}} {value}" for name, value in rows]


@dataclass(frozen=True)
class StatsSnapshot:
    """The server's token counts and the engine's usage (`Engine.usage`) at one moment (`time.monotonic`)."""

    time: float
    tally: TokenTally
    usage: dict


def snapshot(tally: TokenTally, usage: dict) -> StatsSnapshot:
    return StatsSnapshot(time.monotonic(), replace(tally), usage)


def stats_line(before: StatsSnapshot, after: StatsSnapshot, prefix_caching: bool) -> str | None:
    """vLLM's throughput line over the time between two snapshots (the prefix cache's hit rate only where
    `prefix_caching` is on); None when nothing happened in between."""
    moved = after.tally.since(before.tally)
    if after.usage["steps"] == before.usage["steps"] and moved == TokenTally():
        return None
    seconds = max(after.time - before.time, 1e-9)
    usage = after.usage
    kv_total = usage["kv_blocks_total"]
    parts = [
        f"Avg prompt throughput: {moved.prompt_tokens / seconds:.1f} tokens/s",
        f"Avg generation throughput: {moved.generated_tokens / seconds:.1f} tokens/s",
        f"Running: {usage['running']} seqs",
        f"Waiting: {usage['waiting']} seqs",
        f"KV cache usage: {100 * usage['kv_blocks_used'] / kv_total if kv_total else 0.0:.1f}%",
    ]
    if moved.finished_prompt_tokens and prefix_caching:
        parts.append(f"Prefix cache hit rate: {100 * moved.cached_tokens / moved.finished_prompt_tokens:.1f}%")
    if moved.drafted_tokens:
        parts.append(
            f"Draft acceptance rate: {100 * moved.accepted_tokens / moved.drafted_tokens:.1f}% "
            f"(mean acceptance length {1 + moved.accepted_tokens / moved.spec_rounds:.2f})"
        )
    return ", ".join(parts)


async def log_stats(tally: TokenTally, usage: Callable[[], dict], prefix_caching: bool, interval: float) -> None:
    """Every `interval` seconds, log the throughput line when something happened since the last one; runs until
    cancelled."""
    before = snapshot(tally, usage())
    while True:
        await asyncio.sleep(interval)
        after = snapshot(tally, usage())
        line = stats_line(before, after, prefix_caching)
        if line is not None:
            log.info(line)
        before = after
