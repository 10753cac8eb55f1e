"""Build the drafter an `EngineConfig` asks for (`speculative`): none, ngram, mtp, draft, or a neural one + ngram."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from deltaspec.config import EngineConfig, parse_dtype
from deltaspec.errors import DeltaspecError
from deltaspec.spec.combined import CombinedDrafter
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.ngram import NgramDrafter

CHOICES = ("none", "ngram", "mtp", "draft", "mtp+ngram", "draft+ngram")


def default_draft_model(target_dir: Path) -> Path | None:
    """The shipped draft model next to the embedded default target, if `target_dir` is that target."""
    draft = target_dir.parent / "draft"
    return draft if target_dir.name == "target" and (draft / "config.json").is_file() else None


def make_drafter(config: EngineConfig, target_dir: Path, target_vocab: int,
                 mtp: Callable[[], Drafter]) -> Drafter | None:
    """None for "none"; a clear error for an unknown drafter, a missing draft model or MTP head.
    `mtp` builds the MTP drafter (it lives on the engine's own model and caches)."""
    if config.speculative not in CHOICES:
        raise DeltaspecError(f"Unknown speculative setting {config.speculative!r}; use one of {', '.join(CHOICES)}.")
    if config.speculative == "none":
        return None
    drafters: list[Drafter] = []
    if "mtp" in config.speculative.split("+"):
        drafters.append(mtp())
    if "draft" in config.speculative.split("+"):
        from deltaspec.model.weights import resolve_model_path
        from deltaspec.spec.draft_model import DraftModelDrafter

        path = resolve_model_path(config.draft_model) if config.draft_model else default_draft_model(target_dir)
        if path is None:
            raise DeltaspecError("speculative='draft' needs --draft-model PATH (only the embedded default model "
                                 "ships its own draft model).")
        drafters.append(DraftModelDrafter(path, target_vocab, parse_dtype(config.dtype),
                                          parse_dtype(config.state_dtype), torch.device(config.device),
                                          config.max_num_seqs, config.max_model_len, config.block_size, config.seed))
    if "ngram" in config.speculative.split("+"):
        drafters.append(NgramDrafter())
    return drafters[0] if len(drafters) == 1 else CombinedDrafter(drafters[0], drafters[1])
