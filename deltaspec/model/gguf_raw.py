"""The bytes of a GGUF checkpoint as stored: one `.gguf` file, or every part of a split one.

Owns opening the file(s) with `gguf.GGUFReader` (memory-mapped, so tensor data stays views of the file), the
split-file convention `NAME-00001-of-0000N.gguf`, the `GGUFTensor` type, the block layout of ggml's types, and
turning a broken or foreign file into one sentence. It is the only module that imports the `gguf` package (it
is needed only to read GGUF files). Nothing here knows a model architecture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.formats import GGUF_TYPES

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor in Hugging Face layout.

    `qtype` is ggml's type name ("F32", "BF16", "Q4_K", ...); `shape` is torch's (out_features, in_features)
    for a matrix, (experts, out_features, in_features) for routed experts. `data` is a numpy float array of
    `shape` for F32 / F16 / F64, else the raw bytes as uint8 `shape[:-1] + (row_bytes,)`: usually a view of
    the memory-mapped file, a copy only where rows had to be reordered. `input_order` is None when the columns
    are Hugging Face's; otherwise stored column j multiplies input feature `input_order[j]` (the stored matrix
    is `W[:, input_order]`), as for a quantized Qwen3.5 `out_proj` whose blocks span several value heads.
    """

    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    input_order: np.ndarray | None = None


@dataclass(frozen=True)
class RawGGUF:
    """The file(s) as stored: metadata of the first part, tensors of all parts by GGUF name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def read_raw(path: Path) -> RawGGUF:
    """The metadata and tensors of `path` and, for the first part of a split file, of all its parts."""
    parts = _part_paths(path)
    readers = [_open(part) for part in parts]
    metadata = _metadata(readers[0])
    count = metadata.get("split.count", 1)
    if count != len(parts):
        raise DeltaspecError(
            f"{path} says it is part of a {count}-part GGUF file but its name says {len(parts)}; "
            "keep llama.cpp's part names NAME-00001-of-0000N.gguf."
        )
    tensors: dict[str, GGUFTensor] = {}
    for number, (part, reader) in enumerate(zip(parts, readers)):
        if len(parts) > 1 and _split_number(reader) != number:
            raise DeltaspecError(f"{part} says it is not part {number + 1} of {len(parts)}; the parts are mixed up.")
        for tensor in reader.tensors:
            if tensor.name in tensors:
                raise DeltaspecError(f"{part} repeats the tensor {tensor.name}; the GGUF file is corrupt.")
            tensors[tensor.name] = _tensor(tensor)
    if len(parts) > 1 and len(tensors) != metadata.get("split.tensors.count"):
        raise DeltaspecError(
            f"The {len(parts)} parts of {path} hold {len(tensors)} tensors but should hold "
            f"{metadata.get('split.tensors.count')}; a part is missing or corrupt."
        )
    return RawGGUF(path=path, metadata=metadata, tensors=tensors)


def _part_paths(path: Path) -> list[Path]:
    """`path` alone, or all parts of the split file whose first part `path` is."""
    if not path.is_file():
        raise DeltaspecError(f"No GGUF file at {path}; give the path of an existing .gguf file.")
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    number, count = int(match["no"]), int(match["count"])
    if number != 1:
        raise DeltaspecError(f"{path} is part {number} of a split GGUF file; give its first part (-00001-of-).")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    if missing := [part.name for part in parts if not part.is_file()]:
        raise DeltaspecError(f"The split GGUF file {path} lacks its part(s) {', '.join(missing)}.")
    return parts


def _gguf():
    """The `gguf` package (llama.cpp's gguf-py)."""
    try:
        import gguf
    except ImportError:
        raise DeltaspecError("Reading GGUF files needs the gguf package; install it with `pip install gguf`.") from None
    return gguf


def _version(gguf) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "gguf " + version("gguf")
    except PackageNotFoundError:
        return f"gguf-py at {Path(gguf.__file__).parent}"


def block_layout(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) of the ggml type `qtype`: (1, 2) for BF16, (32, 34) for Q8_0."""
    gguf = _gguf()
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def _open(path: Path):
    """A `gguf.GGUFReader` for `path`, or one sentence saying why the file cannot be read."""
    gguf = _gguf()
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise DeltaspecError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes).")
    try:
        reader = gguf.GGUFReader(path, "r")
    except ValueError as exc:
        if unknown := UNKNOWN_TYPE.search(str(exc)):
            raise DeltaspecError(
                f"{path} stores a tensor in ggml type {unknown[1]}, which the installed gguf package "
                f"({_version(gguf)}) does not know (llama.cpp added it later); deltaspec reads {', '.join(GGUF_TYPES)}."
            ) from None
        raise DeltaspecError(f"{path} is truncated or corrupt and cannot be read as GGUF ({exc}).") from None
    except Exception as exc:  # noqa: BLE001 - the reader fails on broken files with assorted error types
        raise DeltaspecError(f"{path} is truncated or corrupt and cannot be read as GGUF ({exc}).") from None
    if reader.byte_order == "S":
        raise DeltaspecError(f"{path} is a big-endian GGUF file; deltaspec reads little-endian ones.")
    size = path.stat().st_size
    if any(t.data_offset + t.n_bytes > size for t in reader.tensors):
        raise DeltaspecError(f"{path} is truncated: its tensor data ends before the tensors it lists.")
    return reader


def _split_number(reader) -> int | None:
    """The part number (from 0) a split file's part says it is."""
    field = reader.fields.get("split.no")
    return None if field is None else int(field.contents())


def _metadata(reader) -> dict[str, Any]:
    """The key/value metadata as Python values (lists for arrays), the GGUF header fields left out."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as exc:  # noqa: BLE001 - a corrupt field fails in numpy or in string decoding
            raise DeltaspecError(f"The GGUF metadata field {key} is corrupt ({exc}).") from None
    return out


def _tensor(tensor) -> GGUFTensor:
    """A file tensor as a GGUFTensor: torch-order shape, the reader's view of its data."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return GGUFTensor(qtype=tensor.tensor_type.name, shape=shape, data=tensor.data)
