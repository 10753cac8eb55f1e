"""The float checkpoint a GGUF file is written from: a Hugging Face directory (or hub id, or the embedded default
model), or a float GGUF file.

Owns reading it as llama.cpp's converter reads it (conversion/base.py `index_tensors`): the config.json
hyperparameters with `text_config` merged into the root, and the tensors in the converter's order (the
safetensors parts sorted by file name, each part's tensors sorted by name), streamed one at a time, float16
tensors as float16 and every other dtype as float32. A float GGUF file (F32 / F16 / BF16 tensors) is read back to
Hugging Face names and values with `read_gguf` and its tensors taken in name order; its tokenizer metadata is
copied. Quantized checkpoints of either kind are refused: they are not the float weights a quantizer starts from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_config import ARCHITECTURES
from deltaspec.model.gguf_file import read_gguf
from deltaspec.model.gguf_load import float_tensor
from deltaspec.model.gguf_raw import read_raw
from deltaspec.model.gguf_write_names import hf_name
from deltaspec.model.hf_config import parse_model_config, read_config_json
from deltaspec.model.safetensors_files import checkpoint_files, open_safetensors
from deltaspec.model.weights import count_mtp_layers, model_dir_for

ARCH_OF_MODEL_TYPE = {model_type: arch for arch, (model_type, _) in ARCHITECTURES.items()}
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FLOAT_QTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Source:
    """A float checkpoint: where it is, its hyperparameters (`hparams`, config.json as the converter reads it),
    its `ModelConfig`, GGUF architecture, MTP layers, and how to stream its tensors."""

    path: Path
    hparams: dict[str, Any]
    config: ModelConfig
    arch: str
    num_mtp: int
    name: str | None  # general.name to give (None: gguf-py's Metadata derives it from the directory)
    gguf_metadata: dict[str, Any] | None  # a GGUF source's metadata (its tokenizer is copied from it)

    def tensors(self, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) in the converter's order; `meta`: shapes and dtypes only, nothing read."""
        if self.gguf_metadata is None:
            yield from _safetensors_tensors(self.path, meta)
        else:
            yield from _gguf_tensors(self.path, meta)


def open_source(model: str | None) -> Source:
    """The float checkpoint `model` names (a directory, hub id or .gguf file; None: the embedded default model)."""
    path = model_dir_for(model)
    if path.is_file():
        return _gguf_source(path)
    raw = read_config_json(path)
    if raw.get("quantization_config"):
        raise DeltaspecError(f"{path} is a quantized checkpoint; quantizing starts from float weights.")
    hparams = {**raw, **(raw.get("text_config") or {})}
    config = parse_model_config(raw)
    names = [name for name, _ in _safetensors_tensors(path, meta=True)]
    local = model is None or Path(model).expanduser().exists()
    return Source(
        path,
        hparams,
        config,
        ARCH_OF_MODEL_TYPE[config.model_type],
        count_mtp_layers(names),
        None if local else model,
        None,
    )


def _part_files(model_dir: Path) -> list[Path]:
    """The safetensors parts in the converter's order: those of the index, else the `model*.safetensors` files."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(checkpoint_files(model_dir).values()))
    parts = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not parts:
        raise DeltaspecError(f"{model_dir} has no *.safetensors weights; deltaspec loads safetensors checkpoints.")
    return parts


def _safetensors_tensors(model_dir: Path, meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for part in _part_files(model_dir):
        with open_safetensors(part) as f:
            for key in sorted(f.keys()):
                name = hf_name(key)
                if name is None:
                    continue
                if meta:
                    piece = f.get_slice(key)
                    dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise DeltaspecError(
                            f"{part} stores {key} as {piece.get_dtype()}; quantizing starts from float weights."
                        )
                    yield name, torch.empty(piece.get_shape(), dtype=dtype, device="meta")
                else:
                    yield name, f.get_tensor(key)


def _gguf_source(path: Path) -> Source:
    raw = read_raw(path)
    if quantized := sorted({t.qtype for t in raw.tensors.values()} - set(FLOAT_QTYPES)):
        raise DeltaspecError(
            f"{path} holds {', '.join(quantized)} tensors; quantizing starts from a float (F32, F16 or BF16) file."
        )
    checkpoint = read_gguf(path, grouped_qkvz=True)
    config = parse_model_config(checkpoint.config)
    return Source(
        path,
        checkpoint.config,
        config,
        ARCH_OF_MODEL_TYPE[config.model_type],
        config.num_mtp_layers,
        raw.metadata.get("general.name"),
        raw.metadata,
    )


def _gguf_tensors(path: Path, meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = read_gguf(path, grouped_qkvz=True).tensors  # Hugging Face's layout, as the writer takes it
    for name in sorted(tensors):
        tensor = tensors[name]
        dtype = torch.float16 if tensor.qtype == "F16" else torch.float32
        if meta:
            yield name, torch.empty(tensor.shape, dtype=dtype, device="meta")
        else:
            yield name, float_tensor(tensor, dtype, torch.device("cpu"))
