"""`read_gguf`: a GGUF checkpoint (llama.cpp's format) as deltaspec loads it.

Owns putting the pieces together: the stored file(s) (`gguf_raw`), the transformers-style config built from
the metadata (`gguf_config`), the tensors under their Hugging Face names with llama.cpp's conversion undone
(`gguf_names`), and the tokenizer (`gguf_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaspec.model.generation_config import gguf_sampling_defaults
from deltaspec.model.gguf_config import config_from_gguf
from deltaspec.model.gguf_names import hf_tensors
from deltaspec.model.gguf_raw import GGUFTensor, read_raw
from deltaspec.model.gguf_tokenizer import tokenizer_from_gguf
from deltaspec.model.tokenizer import Tokenizer

__all__ = ["GGUFCheckpoint", "GGUFTensor", "read_gguf"]


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF checkpoint: a transformers-style config dict, the tensors by Hugging Face name, the tokenizer
    (None when the file has no tokenizer metadata), and the sampling defaults its `general.sampling.*` keys set."""

    config: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    tokenizer: Tokenizer | None
    sampling_defaults: dict[str, float | int]


def read_gguf(path: str | Path, grouped_qkvz: bool = False) -> GGUFCheckpoint:
    """Read the GGUF checkpoint at `path` (a `.gguf` file, or the first part of a split one); a Qwen3-Next file's
    GDN input projections as separate ones (as the engine loads them), or with `grouped_qkvz` as its Hugging Face
    checkpoint groups them (`gguf_names`)."""
    raw = read_raw(Path(path))
    config = config_from_gguf(raw)
    return GGUFCheckpoint(
        config=config,
        tensors=hf_tensors(raw, config, grouped_qkvz),
        tokenizer=tokenizer_from_gguf(raw),
        sampling_defaults=gguf_sampling_defaults(Path(path), raw.metadata),
    )
