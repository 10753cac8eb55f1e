"""The drafter an `EngineConfig` asks for (`speculative`: none, ngram, mtp, draft, block, or a neural one + ngram),
and the device memory it will hold, for the memory planner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from deltaspec.cache.memory_plan import DrafterMemory, Workspace, plan_memory, weight_bytes
from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.engine import EngineConfig
from deltaspec.config.model import ModelConfig
from deltaspec.config.resolve import cache_spec
from deltaspec.errors import DeltaspecError
from deltaspec.model.block_drafter import BlockDrafterConfig, block_drafter_config
from deltaspec.model.checkpoint_names import target_name
from deltaspec.model.gguf_load import gguf_weight_bytes
from deltaspec.model.safetensors_files import checkpoint_files
from deltaspec.model.weights import resolve_model_path
from deltaspec.spec.combined import CombinedDrafter
from deltaspec.spec.draft_model import DraftModelDrafter, draft_checkpoint
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.ngram import NgramDrafter

EARLIER_OCCURRENCES = 3  # with trees, the n-gram drafter's branches from earlier occurrences of its longest match
CHOICES = ("none", "ngram", "mtp", "draft", "block", "mtp+ngram", "draft+ngram", "block+ngram")


def check_choice(speculative: str) -> None:
    if speculative not in CHOICES:
        raise DeltaspecError(f"Unknown speculative setting {speculative!r}; use one of {', '.join(CHOICES)}.")


def uses(speculative: str, drafter: str) -> bool:
    """Whether the `speculative` setting runs `drafter` ("mtp", "draft", "block" or "ngram")."""
    return drafter in speculative.split("+")


def default_draft_model(target_dir: Path | None, kind: str = "draft") -> Path | None:
    """The shipped drafter of `kind` ("draft" or "block") next to the embedded default target, if `target_dir` is
    that target and ships one."""
    if target_dir is None:
        return None
    draft = target_dir.parent / kind
    return draft if target_dir.name == "target" and (draft / "config.json").is_file() else None


def draft_model_dir(config: EngineConfig, target_dir: Path | None, kind: str = "draft") -> Path:
    """The drafter checkpoint of `kind` ("draft": a draft model; "block": a block drafter): --draft-model, or the
    one shipped with the embedded default model."""
    path = (
        resolve_model_path(config.speculation.draft_model)
        if config.speculation.draft_model
        else default_draft_model(target_dir, kind)
    )
    if path is None:
        what = "draft model" if kind == "draft" else "block drafter (a DFlash-layout directory)"
        raise DeltaspecError(
            f"speculative={kind!r} needs --draft-model PATH to a {what}; only the embedded default model ships its own."
        )
    return path


def block_drafter_dir(config: EngineConfig, target_dir: Path | None) -> Path | None:
    """The block drafter's directory; None for a random-weight model without --draft-model, which drafts with a
    random drafter sized for its shape (benchmarks of the drafter's cost)."""
    if config.load.random_weights and not config.speculation.draft_model:
        return None
    return draft_model_dir(config, target_dir, "block")


def drafter_memory(
    config: EngineConfig, target_dir: Path | None, model_config: ModelConfig, mtp_weights: int
) -> DrafterMemory:
    """Device memory of the drafter of a resolved `config`: the MTP head's weights (`mtp_weights` bytes) and
    KV, a draft model's weights, KV pages and state slots (a slot and its snapshot per stream), or a block
    drafter's weights, context keys and values (every stream's whole context; a sliding-window layer's, two
    windows per stream) and the tapped features each pass returns. The n-gram drafter's index lives in host memory
    (a few hundred bytes per context token) and is not counted."""
    check_choice(config.speculation.speculative)
    one_page = cache_spec(config, streams=1, ctx=config.cache.block_size, kv_blocks=0).for_draft_model()
    dtype = one_page.dtype
    if uses(config.speculation.speculative, "mtp"):
        size = torch.empty(0, dtype=dtype).element_size()
        kv = model_config.num_mtp_layers * 2 * model_config.num_key_value_heads * model_config.head_dim * size
        return DrafterMemory(config.speculation.speculative, weights=mtp_weights, kv_per_token=kv, shares_pool=True)
    if uses(config.speculation.speculative, "block"):
        size = torch.empty(0, dtype=dtype).element_size()
        path = block_drafter_dir(config, target_dir)
        if path is None:
            block = BlockDrafterConfig.sized_for(model_config)
            weights = block.num_parameters() * size
        else:
            block = block_drafter_config(path)
            weights = weight_bytes(checkpoint_files(path), dtype, skip=lambda name: False)
        return DrafterMemory(
            config.speculation.speculative,
            weights=weights,
            kv_per_token=block.kv_bytes_per_token(dtype),
            state_per_stream=block.window_bytes_per_stream(dtype),
            features_per_row=len(block.target_layer_ids) * block.target_hidden_size * size,
        )
    if uses(config.speculation.speculative, "draft"):
        path = draft_model_dir(config, target_dir)
        _, draft_config, gguf = draft_checkpoint(path)
        if gguf is not None:
            weights = gguf_weight_bytes(gguf, dtype, with_mtp=False)[0]
        else:
            files = checkpoint_files(path)
            weights = weight_bytes(files, dtype, skip=lambda name: target_name(name, with_mtp=False) is None)
        plan = plan_memory(draft_config, one_page, weights, Workspace(batch_rows=1, prefill_chunk=1), available=0)
        return DrafterMemory(
            config.speculation.speculative,
            weights=plan.weights,
            kv_per_token=plan.kv_per_token,
            state_per_stream=2 * plan.state_per_stream,
        )
    return DrafterMemory(config.speculation.speculative)


def make_drafter(
    config: EngineConfig,
    cache: CacheSpec,
    target_dir: Path | None,
    target_vocab: int,
    mtp: Callable[[], Drafter],
    block: Callable[[Path | None], Drafter],
) -> Drafter | None:
    """None for "none"; a clear error for an unknown drafter, a missing draft model or MTP head.
    `mtp` builds the MTP drafter (it lives on the engine's own model and caches), `block` the block drafter from
    its checkpoint directory, or a random one sized for the model when that is None (it reads the engine's
    model's features, embeddings and LM head)."""
    check_choice(config.speculation.speculative)
    if config.speculation.speculative == "none":
        return None
    drafters: list[Drafter] = []
    if uses(config.speculation.speculative, "mtp"):
        drafters.append(mtp())
    if uses(config.speculation.speculative, "block"):
        drafters.append(block(block_drafter_dir(config, target_dir)))
    if uses(config.speculation.speculative, "draft"):
        drafters.append(
            DraftModelDrafter(
                draft_model_dir(config, target_dir), target_vocab, cache.for_draft_model(), config.scheduler.seed
            )
        )
    if uses(config.speculation.speculative, "ngram"):
        earlier = EARLIER_OCCURRENCES if config.speculation.speculative_tree else 0
        drafters.append(
            NgramDrafter(config.speculation.prompt_lookup_min, config.speculation.prompt_lookup_max, earlier=earlier)
        )
    return drafters[0] if len(drafters) == 1 else CombinedDrafter(drafters[0], drafters[1])
