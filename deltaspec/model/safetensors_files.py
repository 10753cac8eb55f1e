"""The files of a safetensors checkpoint and what their headers list, read and checked before any tensor is.

Owns which files make up a checkpoint (the shards `model.safetensors.index.json` names, else every
`*.safetensors` file of the directory), keeping every file the index names inside the model's directory (no
absolute path, no `..`), and reading each file's header in bounded time and memory: the header length, its JSON,
each tensor's dtype, shape and data offsets, checked against the file's size. A file that fails any check is
refused in one sentence before a tensor is read, so every later `safe_open` of these files succeeds. Symbolic
links are followed: the Hugging Face hub cache's snapshot files are links into its `blobs` folder.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePath

from safetensors import safe_open

from deltaspec.errors import DeltaspecError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 * 2**20
CORRUPT = "corrupt, so download it again"
PATH_SHOWN = 400  # characters of a file name a message quotes (other values: 60)
# bits per element of every dtype the safetensors format defines
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header lists it: the file holding it, its dtype name and its shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the safetensors file that holds it (every file checked)."""
    return {name: tensor.file for name, tensor in checkpoint_tensors(model_dir).items()}


def checkpoint_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint at `model_dir` as its file's header lists it; each file's header is read
    and checked once, and a tensor the index maps to a file that does not hold it is refused."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        mapping = index_shards(model_dir, index)
        headers = {file: read_header(file) for file in sorted(set(mapping.values()))}
        for name, file in mapping.items():
            if name not in headers[file]:
                raise DeltaspecError(f"{index} puts the tensor {name} in {file.name}, which does not hold it.")
        return {name: headers[file][name] for name, file in mapping.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DeltaspecError(f"{model_dir} has no *.safetensors weights; deltaspec loads safetensors checkpoints.")
    tensors: dict[str, StoredTensor] = {}
    for file in files:
        tensors.update(read_header(file))
    return tensors


def index_shards(model_dir: Path, index: Path) -> dict[str, Path]:
    """The index's tensor name -> shard file, every shard a file inside `model_dir` (checked before any is
    opened)."""
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise DeltaspecError(f"{index} is larger than {MAX_INDEX_BYTES >> 20} MiB, so it is no safetensors index.")
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        pairs = list(weight_map.items())
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        raise DeltaspecError(f"{index} is not a valid safetensors index ({type(exc).__name__}: {exc}).") from None
    mapping = {name: model_dir / shard_name(index, file_name) for name, file_name in pairs}
    if absent := sorted({f.name for f in mapping.values() if not f.exists()}):
        raise DeltaspecError(f"{index} names shard files that are missing: {', '.join(absent)}.")
    return mapping


def shard_name(index: Path, file_name: object) -> PurePath:
    """`file_name` from the index as a path relative to the model's directory; one sentence for anything that
    could lead outside it (an absolute path, a `..` part) or is not a file name."""
    if not isinstance(file_name, str) or not file_name.strip():
        raise DeltaspecError(f"{index} names a shard file {_shown(file_name, PATH_SHOWN)}, which is not a file name.")
    path = PurePath(file_name)
    if path.is_absolute() or ".." in path.parts:
        raise DeltaspecError(
            f"{index} names the shard file {_shown(file_name, PATH_SHOWN)}, which lies outside the model's directory; "
            "an index may only name files inside it."
        )
    return path


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors `file`'s safetensors header lists, after checking that the header and every tensor's data lie
    within the file; safetensors itself then opens the file once to agree."""
    if not file.is_file():
        raise DeltaspecError(f"{file} is not a regular file; a checkpoint's shards must be safetensors files.")
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, header_bytes = _header_json(file, f, size)
    data_bytes = size - 8 - header_bytes
    tensors = {name: _tensor(file, name, entry) for name, entry in header.items() if name != "__metadata__"}
    _check_offsets(file, header, data_bytes)
    with open_safetensors(file):
        pass
    return {name: StoredTensor(file, dtype, shape) for name, (dtype, shape) in tensors.items()}


def open_safetensors(file: Path):
    """`safe_open` with a clear error for an unreadable file."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        reason = _first_line(exc)
        raise DeltaspecError(f"{file} is not a readable safetensors file ({reason}); download it again.") from None


def _header_json(file: Path, f, size: int) -> tuple[dict, int]:
    """The JSON header of the open safetensors `file` of `size` bytes and its length in bytes; one sentence if
    the length or the JSON is wrong."""
    if size < 8:
        raise DeltaspecError(f"{file} has {size} bytes, too few for a safetensors header; download it again.")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise DeltaspecError(
            f"{file} says its header is {length} bytes but the file holds {size} bytes (and safetensors allows at "
            f"most {MAX_HEADER_BYTES}); the file is truncated or corrupt, so download it again."
        )
    raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or not raw.lstrip().startswith(b"{"):
        raise DeltaspecError(f"{file} has a header that is not a JSON object; the file is {CORRUPT}.")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DeltaspecError(f"{file} has __metadata__ that is not a map of strings; the file is {CORRUPT}.")
    return header, length


def _tensor(file: Path, name: str, entry: object) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of the header entry of tensor `name`; one sentence for a malformed entry or an unknown
    dtype."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise DeltaspecError(
            f"{file} lists the tensor {_shown(name)} without its dtype, shape and data_offsets; the file is {CORRUPT}."
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise DeltaspecError(
            f"{file} stores the tensor {_shown(name)} as {_shown(dtype)}, which is not a safetensors dtype; the "
            "file is corrupt or written by a newer safetensors, so download it again or upgrade safetensors."
        )
    if not isinstance(shape, list) or not all(_whole(n) for n in shape):
        raise DeltaspecError(
            f"{file} gives the tensor {_shown(name)} the shape {_shown(shape)}, which is no shape; the file is "
            f"{CORRUPT}."
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(n) for n in offsets):
        raise DeltaspecError(
            f"{file} gives the tensor {_shown(name)} data_offsets {_shown(offsets)}, not two offsets; the file is "
            f"{CORRUPT}."
        )
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        needed = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits, not a whole number of bytes"
        raise DeltaspecError(
            f"{file} gives the tensor {_shown(name)} {offsets[1] - offsets[0]} bytes at data_offsets {offsets}, but "
            f"{dtype} of shape {shape} takes {needed}; the file is {CORRUPT}."
        )
    return dtype, tuple(shape)


def _check_offsets(file: Path, header: dict, data_bytes: int) -> None:
    """The tensors' data must tile the file's data section: back to back from its first byte to its last."""
    spans = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    for (start, stop), name in spans:
        if stop > data_bytes:
            raise DeltaspecError(
                f"{file} puts the tensor {_shown(name)} at data bytes {start} to {stop}, but the file holds "
                f"{data_bytes} bytes of data; the file is truncated or corrupt, so download it again."
            )
    end = 0
    for (start, stop), name in spans:
        if start != end:
            raise DeltaspecError(
                f"{file} puts the tensor {_shown(name)} at data byte {start} where byte {end} was expected "
                f"(tensors overlap or leave a gap); the file is {CORRUPT}."
            )
        end = stop
    if end != data_bytes:
        raise DeltaspecError(
            f"{file} holds {data_bytes} bytes of data but its tensors cover {end}; the file is {CORRUPT}."
        )


def _whole(value: object) -> bool:
    """Whether `value` is a JSON whole number of at least 0 (booleans are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: object, limit: int = 60) -> str:
    """`value` as a message quotes it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: Exception) -> str:
    """The first line of an exception's message, or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
