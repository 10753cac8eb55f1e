"""Resolution of an `EngineConfig`: its "auto" device and dtypes decided and its values checked
(`resolve_engine_config`, one pure function), the context checked against the model's positions, the pools
the planner decides written in (`with_pools`), and the one derivation of the cache facts every cache reader takes
(`cache_spec`: torch dtypes, pages, slots, log rows, checkpoints, graph buckets)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.dtypes import parse_dtype, parse_kv_dtype
from deltaspec.config.engine import DEFAULT_IMAGES_PER_PROMPT, MAX_TREE_ROWS, EngineConfig, SpeculativeConfig
from deltaspec.config.graph_buckets import uses_cuda_graphs
from deltaspec.config.host import default_threads
from deltaspec.errors import DeltaspecError

CHECKPOINTS_PER_STREAM = 3  # a long request leaves up to three: 512 and 64 tokens before its prompt's end, its end


def resolve_engine_config(cfg: EngineConfig, checkpoint_dtype: str | None) -> EngineConfig:
    """Resolve the "auto" device and dtypes of `cfg` and check its values; the streams, context, KV pool and
    prefix checkpoints depend on the memory and are decided by the planner (`with_pools`).

    dtype auto: the checkpoint's own `torch_dtype` on CUDA, float32 on CPU (bfloat16 matmuls are
    slow there). state_dtype auto: float32, or float64 for a float64 model. kv_cache_dtype auto: the model's dtype
    (named as it, "fp8" as "fp8_e4m3").
    """
    device = cfg.host.device_name()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeltaspecError(f"Device {device!r} was asked for but CUDA is not available; use --device cpu.")
    if cfg.load.dtype == "auto":
        dtype = (checkpoint_dtype or "bfloat16") if device.startswith("cuda") else "float32"
    else:
        dtype = cfg.load.dtype
    dtype_name = str(parse_dtype(dtype)).removeprefix("torch.")
    if cfg.cache.state_dtype == "auto":
        state_dtype = "float64" if dtype_name == "float64" else "float32"
    else:
        state_dtype = str(parse_dtype(cfg.cache.state_dtype)).removeprefix("torch.")
    parse_kv_dtype(cfg.cache.kv_cache_dtype, dtype_name)
    kv_cache_dtype = (
        dtype_name
        if cfg.cache.kv_cache_dtype == "auto"
        else {"fp8": "fp8_e4m3"}.get(cfg.cache.kv_cache_dtype, cfg.cache.kv_cache_dtype)
    )
    if cfg.cache.prefix_offload_gib < 0:
        raise DeltaspecError(f"prefix_offload_gib must be 0 (no offload) or more, got {cfg.cache.prefix_offload_gib}.")
    if cfg.cache.prefix_checkpoints < 0:
        raise DeltaspecError(
            f"prefix_checkpoints must be 0 (three per stream) or more, got {cfg.cache.prefix_checkpoints}."
        )
    if cfg.load.fp8_activations not in ("none", "dynamic"):
        raise DeltaspecError(f"Unknown --fp8-activations {cfg.load.fp8_activations!r}; use none or dynamic.")
    if cfg.speculation.speculative_tree and not 2 <= cfg.speculation.speculative_tree <= MAX_TREE_ROWS:
        raise DeltaspecError(
            f"speculative_tree is the most nodes of a tree of drafts, 2 to {MAX_TREE_ROWS} (0: chains); got "
            f"{cfg.speculation.speculative_tree}."
        )
    if cfg.speculation.speculative_tree and cfg.speculation.draft_tokens >= MAX_TREE_ROWS:
        raise DeltaspecError(
            f"With speculative_tree a draft is at most {MAX_TREE_ROWS - 1} tokens deep; got draft_tokens "
            f"{cfg.speculation.draft_tokens}."
        )
    if cfg.speculation.speculative_tree_shape not in ("dynamic", "static"):
        raise DeltaspecError(
            f"Unknown speculative_tree_shape {cfg.speculation.speculative_tree_shape!r}; use dynamic or static."
        )
    if not 1 <= cfg.speculation.prompt_lookup_min <= cfg.speculation.prompt_lookup_max:
        raise DeltaspecError(
            "The n-gram drafter needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
            f"{cfg.speculation.prompt_lookup_min} and {cfg.speculation.prompt_lookup_max}."
        )
    if cfg.host.threads is not None and cfg.host.threads < 1:
        raise DeltaspecError(
            f"threads must be at least 1, got {cfg.host.threads}; leave it out for the physical cores."
        )
    images_per_prompt(cfg.load.limit_mm_per_prompt)  # refuses a malformed limit before anything loads
    if cfg.host.kernels not in ("auto", "reference"):
        raise DeltaspecError(f"Unknown kernels setting {cfg.host.kernels!r}; use auto or reference.")
    if not 0 <= cfg.cache.gpu_memory_utilization <= 1:
        raise DeltaspecError(
            f"gpu_memory_utilization is a fraction of the device's memory in (0, 1], or 0 for pools of exactly "
            f"streams x context; got {cfg.cache.gpu_memory_utilization}."
        )
    if cfg.cache.gpu_memory_utilization and cfg.cache.num_kv_blocks:
        raise DeltaspecError("--gpu-memory-utilization sizes the KV pool itself; give it or --num-kv-blocks, not both.")
    settings = cfg.flat()
    for name in ("max_num_seqs", "max_model_len", "num_kv_blocks"):
        if settings[name] < 0:
            raise DeltaspecError(f"{name} must be 0 (automatic) or more, got {settings[name]}.")
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "block_size",
        "max_num_batched_tokens",
        "prefill_chunk",
        "draft_tokens",
    ):
        if settings[name] < 1:
            raise DeltaspecError(f"{name} must be at least 1, got {settings[name]}.")
    if settings["pipeline_micro_batches"] < 0:
        raise DeltaspecError(
            f"pipeline_micro_batches must be 0 (one per stage) or more, got {settings['pipeline_micro_batches']}."
        )
    chat_template = None if cfg.load.chat_template is None else chat_template_text(cfg.load.chat_template)
    return cfg.with_settings(
        device=device,
        dtype=dtype_name,
        state_dtype=state_dtype,
        kv_cache_dtype=kv_cache_dtype,
        chat_template=chat_template,
        threads=cfg.host.threads or default_threads(),
    )


def chat_template_text(template: str) -> str:
    """The Jinja source `--chat-template` gives, read as vLLM reads it: text with a brace or a newline is the
    template itself, anything else names its file."""
    if any(char in template for char in "{}\n"):
        return template
    try:
        return Path(template).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DeltaspecError(
            f"--chat-template {template!r} is neither a file nor a Jinja template; give a template file or its text "
            "(deltaspec ships no named templates, and without the flag it uses the model's own)."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DeltaspecError(f"Could not read the chat template file {template} ({exc}).") from None


def check_context(cfg: EngineConfig, positions: int) -> None:
    """Refuse a --max-model-len beyond the model's trained positions unless it is explicitly allowed."""
    if cfg.scheduler.max_model_len > positions and not cfg.scheduler.allow_long_max_model_len:
        raise DeltaspecError(
            f"--max-model-len {cfg.scheduler.max_model_len} exceeds the model's max_position_embeddings "
            f"({positions}); use {positions} or less, or add --allow-long-max-model-len to run past the positions it "
            "was trained on."
        )


def with_pools(cfg: EngineConfig, streams: int, ctx: int, kv_blocks: int) -> EngineConfig:
    """`cfg` with its streams, context and KV pool decided (by the planner) and its prefix checkpoints counted:
    0 means three per stream, none without prefix caching."""
    pool = kv_blocks * cfg.cache.block_size
    if kv_blocks and pool < ctx:
        raise DeltaspecError(
            f"The KV pool of {kv_blocks} pages x {cfg.cache.block_size} tokens ({pool} tokens) cannot hold one full "
            f"context of {ctx} tokens; use --num-kv-blocks {-(-ctx // cfg.cache.block_size)} or more, or "
            f"--max-model-len {pool} or less."
        )
    return cfg.with_settings(
        max_num_seqs=streams,
        max_model_len=ctx,
        num_kv_blocks=kv_blocks,
        prefix_checkpoints=checkpoint_slots(cfg, streams),
    )


def checkpoint_slots(cfg: EngineConfig, streams: int) -> int:
    """Prefix-checkpoint slots: `prefix_checkpoints`, 0 meaning three per stream; none without prefix caching."""
    if not cfg.cache.enable_prefix_caching:
        return 0
    return cfg.cache.prefix_checkpoints or CHECKPOINTS_PER_STREAM * streams


def log_rows(speculation: SpeculativeConfig) -> int:
    """Rows of each state slot's speculative replay log: the rows of a verify pass (the drafts plus the bonus row,
    or a tree's nodes), 0 without speculation."""
    if speculation.speculative == "none":
        return 0
    return max(speculation.draft_tokens + 1, speculation.speculative_tree)


def cache_spec(cfg: EngineConfig, streams: int, ctx: int, kv_blocks: int) -> CacheSpec:
    """The cache facts of a resolved `cfg` run with `streams` streams of `ctx` tokens and a KV pool of `kv_blocks`
    pages (0: one whole context per stream): what the planner sizes and the allocator, the graphs and the ranks
    build."""
    dtype = parse_dtype(cfg.load.dtype)
    return CacheSpec(
        device=torch.device(cfg.host.device),
        dtype=dtype,
        state_dtype=parse_dtype(cfg.cache.state_dtype),
        kv_dtype=parse_kv_dtype(cfg.cache.kv_cache_dtype, dtype),
        block_size=cfg.cache.block_size,
        kv_blocks=kv_blocks,
        streams=streams,
        max_model_len=ctx,
        log_rows=log_rows(cfg.speculation),
        checkpoint_slots=checkpoint_slots(cfg, streams),
        offload_bytes=int(cfg.cache.prefix_offload_gib * 2**30),
        cuda_graphs=uses_cuda_graphs(cfg.host.device, cfg.host.enforce_eager, cfg.host.kernels)
        and cfg.parallel.pipeline_parallel_size == 1,  # a pipeline stage's passes wait on its neighbours: eager
    )


def images_per_prompt(limit: str | None) -> int:
    """The most images a prompt may carry, from `limit_mm_per_prompt` as vLLM spells it: a JSON object
    {"image": N} or image=N (other modalities may be named with 0); None: the default."""
    if limit is None:
        return DEFAULT_IMAGES_PER_PROMPT
    try:
        if limit.lstrip().startswith("{"):
            parsed = json.loads(limit)
        else:
            parsed = {key.strip(): int(value) for key, value in (part.split("=") for part in limit.split(","))}
    except ValueError:
        parsed = None
    counts = parsed.values() if isinstance(parsed, dict) else [None]
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in counts) or any(
        n for key, n in (parsed or {}).items() if key != "image"
    ):
        raise DeltaspecError(
            f'limit_mm_per_prompt {limit!r} is not a limit deltaspec reads; give {{"image": N}} or image=N with N >= 0 '
            "(images are the one modality it takes)."
        )
    return parsed.get("image", DEFAULT_IMAGES_PER_PROMPT)
