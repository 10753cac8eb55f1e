"""The memory plan of an engine configuration (DESIGN §4), in one place, before anything is allocated.

`plan_for` resolves the configuration against its checkpoint (or its `--random-weights` shape), counts the
weights the engine will load (from the safetensors headers, or the shape's parameter count), the
drafter's memory (`deltaspec.spec.factory.drafter_memory`; an injected drafter owns its memory), the
replay logs, the prefix checkpoints and the captured CUDA graphs, and returns the `MemoryPlan` with what
was resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from deltaspec.cache.memory_plan import DrafterMemory, MemoryPlan, plan_memory, weight_bytes
from deltaspec.config import EngineConfig, ModelConfig, parse_dtype, resolve_engine_config
from deltaspec.errors import DeltaspecError
from deltaspec.execution.graph_buckets import graph_rows_of
from deltaspec.model.hf_config import checkpoint_dtype, parse_model_config, read_config_json
from deltaspec.model.shapes import parameter_counts, shape_config
from deltaspec.model.weights import checkpoint_files, count_mtp_layers, model_dir_for, target_name
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.factory import drafter_memory, uses


@dataclass(frozen=True)
class Planned:
    plan: MemoryPlan
    config: EngineConfig  # resolved: no "auto" left; `speculative` names the drafter that will run
    model_config: ModelConfig
    raw: dict  # the checkpoint's config.json ({} for random weights)
    model_dir: Path | None  # None for random weights
    with_mtp: bool  # whether the MTP head is loaded: only when it drafts


def plan_for(config: EngineConfig, drafter: Drafter | None = None) -> Planned:
    """The plan of `config`; with an injected `drafter`, speculation runs with it whatever `speculative` says."""
    if config.random_weights or config.shape is not None:
        model_config, raw, model_dir = _random_shape(config), {}, None
        resolved = resolve_engine_config(config, "bfloat16")
    else:
        model_dir = model_dir_for(config.model)
        raw = read_config_json(model_dir)
        files = checkpoint_files(model_dir)
        model_config = replace(parse_model_config(raw), num_mtp_layers=count_mtp_layers(files))  # as loaded
        resolved = resolve_engine_config(config, checkpoint_dtype(raw))
    if drafter is not None:
        resolved = replace(resolved, speculative=drafter.name)
    dtype = parse_dtype(resolved.dtype)
    with_mtp = drafter is None and uses(resolved.speculative, "mtp")
    if model_dir is None:
        counts = parameter_counts(model_config)
        target, mtp = (counts["total"] - counts["mtp"]) * dtype.itemsize, counts["mtp"] * dtype.itemsize
    else:
        target = weight_bytes(files, dtype, skip=lambda name: target_name(name, with_mtp=False) is None)
        mtp = weight_bytes(files, dtype, skip=lambda name: not name.startswith("mtp.")) if with_mtp else 0
    memory = (
        DrafterMemory(drafter.name) if drafter is not None else drafter_memory(resolved, model_dir, model_config, mtp)
    )
    streams, ctx = resolved.max_num_seqs, resolved.max_model_len
    if resolved.num_kv_blocks:
        ctx = resolved.num_kv_blocks * resolved.block_size // streams
    plan = plan_memory(
        model_config,
        len(model_config.attention_layer_ids),
        target,
        dtype,
        parse_dtype(resolved.state_dtype),
        streams,
        ctx,
        resolved.block_size,
        resolved.max_num_batched_tokens,
        resolved.prefill_chunk,
        torch.device(resolved.device),
        log_rows=resolved.log_rows,
        checkpoints=resolved.prefix_checkpoints,
        graph_rows=graph_rows_of(resolved, model_config),
        drafter=memory,
    )
    return Planned(plan, resolved, model_config, raw, model_dir, with_mtp)


def _random_shape(config: EngineConfig) -> ModelConfig:
    """The model config of a `--random-weights --shape` configuration, after checking the flags go together."""
    if not config.random_weights:
        raise DeltaspecError(
            "--shape only applies with --random-weights; add --random-weights, or drop --shape to load a checkpoint."
        )
    if config.shape is None:
        raise DeltaspecError(
            "--random-weights needs --shape NAME (qwen3.5-27b, qwen3.5-9b, qwen3.5-0.8b, "
            "qwen3.5-35b-a3b or qwen3-next-80b-a3b)."
        )
    if config.model is not None:
        raise DeltaspecError("--random-weights builds a model from --shape and loads no checkpoint; drop --model.")
    if uses(config.speculative, "draft") and not config.draft_model:
        raise DeltaspecError("speculative='draft' with --random-weights needs --draft-model PATH; or use mtp or ngram.")
    return replace(shape_config(config.shape, config.shape_overrides), eos_token_ids=())
