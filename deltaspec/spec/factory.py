"""Build the drafter an `EngineConfig` asks for (`speculative`)."""

from __future__ import annotations

from deltaspec.config import EngineConfig
from deltaspec.errors import DeltaspecError
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.ngram import NgramDrafter

DRAFTERS = {"ngram": NgramDrafter}


def make_drafter(config: EngineConfig) -> Drafter | None:
    """None for "none"; a clear error for a drafter deltaspec does not have."""
    if config.speculative == "none":
        return None
    if config.speculative not in DRAFTERS:
        raise DeltaspecError(f"Unknown speculative drafter {config.speculative!r}; available: none, "
                             f"{', '.join(DRAFTERS)}.")
    return DRAFTERS[config.speculative]()
