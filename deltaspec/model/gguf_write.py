"""`write_gguf`: a float checkpoint -> a GGUF file that llama.cpp loads, each tensor at the type llama.cpp's tools
would give it.

Owns the file: the tensors in the converter's order with its names and values (`gguf_write_names`), the
metadata (`gguf_write_meta`), each tensor's type, its bytes (`deltaspec.ops.quant.quantize`, byte-exact with
ggml, with the tensor's importance when there is one), and the writing (gguf-py's `GGUFWriter`: tensor infos
first, then the data streamed tensor by tensor, into `OUT.partial`, renamed to OUT once complete).

The type of a tensor, by `--type`:

- f32, f16, bf16: what `convert_hf_to_gguf.py --outtype` writes: the matrices in that type; 1-D tensors, norms,
  biases, the MoE routers and the conv window in F32;
- q4_k_m, q5_k_m, q6_k, q8_0: what `llama-quantize` makes of the converter's f32 file under that preset
  (`deltaspec.ops.quant.presets`);
- q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, iq4_nl, iq4_xs: what `llama-quantize --pure` makes of it with
  that type: every matrix llama-quantize quantizes in that type, or its 32-element stand-in (then F16) when its
  blocks do not divide the row.

`general.file_type` is the llama.cpp file type those tools write (a pure k-quant: its _M mixture, as
llama-quantize's Q3_K / Q4_K / Q5_K aliases do). With importance (llama.cpp's imatrix), the file also names the
calibration text and its chunks in `quantize.imatrix.*`, as llama-quantize does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_write_meta import (
    add_general,
    add_gguf_sampling,
    add_gguf_tokenizer,
    add_hf_tokenizer,
    add_hyperparameters,
)
from deltaspec.model.gguf_write_names import TensorConverter, layout_for
from deltaspec.model.gguf_write_source import Source
from deltaspec.model.random_quant import pure_type
from deltaspec.ops.quant.formats import row_bytes
from deltaspec.ops.quant.presets import DEFAULT_TYPE, LAYER, preset_types
from deltaspec.ops.quant.quantize import quantize

FLOAT_TYPES = ("F32", "F16", "BF16")
PRESETS = tuple(DEFAULT_TYPE)
PURE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")
FILE_TYPES = {  # --type -> the llama.cpp file type (gguf.LlamaFileType) the tools write
    "Q4_K_M": "MOSTLY_Q4_K_M",
    "Q5_K_M": "MOSTLY_Q5_K_M",
    "Q6_K": "MOSTLY_Q6_K",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "Q2_K": "MOSTLY_Q2_K",
    "Q3_K": "MOSTLY_Q3_K_M",
    "Q4_K": "MOSTLY_Q4_K_M",
    "Q5_K": "MOSTLY_Q5_K_M",
    "IQ4_NL": "MOSTLY_IQ4_NL",
    "IQ4_XS": "MOSTLY_IQ4_XS",
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
    "F32": "ALL_F32",
}
CPU = torch.device("cpu")
CONVERTER_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


@dataclass(frozen=True)
class Importance:
    """llama.cpp's imatrix: per GGUF tensor, the mean squared input of each column ([cols], or [E, cols] for
    routed experts), and what it was measured on (`dataset`: the text's name, `chunks`: windows of it)."""

    values: dict[str, torch.Tensor]
    dataset: str
    chunks: int


def parse_type(name: str) -> str:
    """A --type value as presets and formats spell it (Q4_K_M, F16, ...), or one sentence listing the choices."""
    key = name.upper()
    if key not in FILE_TYPES:
        raise DeltaspecError(f"Unknown --type {name!r}; use one of {', '.join(t.lower() for t in FILE_TYPES)}.")
    return key


def tensor_types(kind: str, plan: list[tuple[str, tuple[int, ...]]], n_layers: int, n_expert: int) -> dict[str, str]:
    """{GGUF tensor: type} under --type `kind` (see the module docstring); `plan` is (name, torch shape)."""
    if kind in FLOAT_TYPES:
        return {name: _converter_type(name, shape, kind) for name, shape in plan}
    if kind in PRESETS:
        return preset_types(kind, [(name, shape, "F32") for name, shape in plan], n_layers=n_layers, n_expert=n_expert)
    return {name: pure_type(kind, name, shape) for name, shape in plan}


def _converter_type(name: str, shape: tuple[int, ...], outtype: str) -> str:
    """`prepare_tensors`: 1-D tensors, norms, what is not a `.weight`, routers and the conv window stay F32."""
    if len(shape) <= 1 or not name.endswith(".weight") or name.endswith(CONVERTER_F32):
        return "F32"
    return outtype


def check_writable(path: Path) -> None:
    """Refuse, before any long work, an output path that cannot be written."""
    partial = _partial(path)
    try:
        partial.open("wb").close()
    except OSError as exc:
        raise DeltaspecError(f"Cannot write the GGUF file {path} ({exc.strerror or exc}).") from None
    partial.unlink()


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _converted(source: Source, meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF tensors of `source`, in the converter's order."""
    moe = source.config.moe
    converter = TensorConverter(layout_for(source.config, source.arch), moe.num_experts if moe else 0)
    for name, tensor in source.tensors(meta):
        yield from converter.convert(name, tensor)
    converter.finish()


def add_tensor_infos(writer: gguf.GGUFWriter, plan: list[tuple[str, tuple[int, ...], str]]) -> None:
    """The tensor infos of the file, in its order (`plan`: name, torch shape, type)."""
    for name, shape, qtype in plan:
        if qtype in ("F32", "F16"):
            dtype = np.dtype(np.float32 if qtype == "F32" else np.float16)
            writer.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize)
            continue
        byte_shape = (*shape[:-1], row_bytes(qtype, shape[-1]))
        raw = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=raw)


def move_quantize_keys(writer: gguf.GGUFWriter, kind: str) -> None:
    """llama-quantize sets these two keys anew, which moves them after the converter's keys."""
    if kind not in FLOAT_TYPES:
        kv = writer.kv_data[0]
        kv |= {key: kv.pop(key) for key in ("general.quantization_version", "general.file_type")}


def encode(tensor: torch.Tensor, qtype: str, importance: torch.Tensor | None, device: torch.device) -> np.ndarray:
    """A GGUF tensor's bytes: float32 / float16 values, or uint8 [..., rows, row_bytes] blocks (BF16 too)."""
    if qtype == "F32":
        return tensor.float().numpy()
    if qtype == "F16":
        return tensor.float().numpy().astype(np.float16)
    matrices = tensor.reshape(-1, *tensor.shape[-2:])  # [experts or 1, rows, cols]
    blocks = [
        quantize(m.to(device), qtype, None if importance is None else importance.reshape(-1, m.shape[-1])[i])
        for i, m in enumerate(matrices)
    ]  # per matrix (expert): [rows, row_bytes]
    return torch.stack(blocks).cpu().numpy().reshape(*tensor.shape[:-1], -1)


def _writer(
    source: Source, kind: str, plan: list[tuple[str, tuple[int, ...], str]], importance: Importance | None
) -> gguf.GGUFWriter:
    """A GGUFWriter holding the file's tensor infos (`plan`: name, torch shape, type) and metadata."""
    writer = gguf.GGUFWriter(None, source.arch)
    add_tensor_infos(writer, plan)
    add_general(writer, source.path if source.gguf_metadata is None else None, source.name)
    if source.gguf_metadata is not None:
        add_gguf_sampling(writer, source.gguf_metadata)
    add_hyperparameters(writer, source.hparams, source.num_mtp, gguf.LlamaFileType[FILE_TYPES[kind]])
    if source.gguf_metadata is None:
        add_hf_tokenizer(writer, source.path, source.config.vocab_size)
    else:
        add_gguf_tokenizer(writer, source.gguf_metadata)
    move_quantize_keys(writer, kind)
    if importance is not None:
        writer.add_string("quantize.imatrix.dataset", importance.dataset)
        writer.add_uint32("quantize.imatrix.entries_count", len(importance.values))
        writer.add_uint32("quantize.imatrix.chunks_count", importance.chunks)
    return writer


def write_gguf(
    source: Source,
    path: Path,
    kind: str,
    importance: Importance | None = None,
    device: torch.device = CPU,
    progress: bool = True,
) -> Counter:
    """Write `source` to the GGUF file `path` with the tensor types of --type `kind`; returns how many tensors got
    each type. The tensors are quantized on `device`, in the converter's order, each written where the file's
    order puts it."""
    plan = file_plan(kind, [(name, tuple(tensor.shape)) for name, tensor in _converted(source, meta=True)])
    moe = source.config.moe
    types = tensor_types(kind, plan, source.config.num_hidden_layers + source.num_mtp, moe.num_experts if moe else 0)
    writer = _writer(source, kind, [(name, shape, types[name]) for name, shape in plan], importance)
    values = importance.values if importance is not None else {}
    encoded = (
        (name, encode(tensor, types[name], values.get(name), device)) for name, tensor in _converted(source, meta=False)
    )
    write_file(writer, path, encoded, types, progress)
    return Counter(types.values())


def write_file(
    writer: gguf.GGUFWriter,
    path: Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    types: dict[str, str],
    progress: bool,
) -> None:
    """Write the file `writer` describes (metadata and tensor infos) to `path`: its header into `OUT.partial`, then
    each tensor's bytes of `tensors` (name, array), in whatever order they come, where the file's order puts it,
    then renamed to `path` once complete. Only the tensor being written is held."""
    offsets, end = _data_offsets(writer)
    partial = _partial(path)
    try:
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        (out,) = writer.fout
        writer.write_padding(out, out.tell())
        start = out.tell()
        bar = tqdm(total=len(offsets), desc=f"Writing {path.name}", unit="tensor", disable=not progress)
        for name, data in tensors:
            bar.set_postfix_str(f"{name} {types[name]}", refresh=False)
            out.seek(start + offsets.pop(name))
            data.tofile(out)
            bar.update()
        bar.close()
        assert not offsets, f"{sorted(offsets)} were planned but never written"
        out.truncate(start + end)  # the padding after the last tensor of the file
        writer.close()
        partial.replace(path)
    except OSError as exc:
        raise DeltaspecError(f"Cannot write the GGUF file {path} ({exc.strerror or exc}).") from None
    finally:
        writer.close()
        partial.unlink(missing_ok=True)


def file_plan(kind: str, plan: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors (name, torch shape) in the order and shapes the file stores them: the converter's for its own
    types; llama-quantize's for the others — by layer (global tensors first), then by name (its model loader's
    `weight_name_comparer`), each shape without the leading dimensions of 1 (ggml's `ggml_n_dims`, which its
    gguf writer stores; e.g. `ffn_gate_inp_shexp` [1, hidden] as [hidden])."""
    if kind in FLOAT_TYPES:
        return plan

    def layer(name: str) -> int:
        return int(match[1]) if (match := LAYER.match(name)) else -1

    def ggml_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        kept = len(shape)
        while kept > 1 and shape[-kept] == 1:
            kept -= 1
        return shape[-kept:]

    return [(name, ggml_shape(shape)) for name, shape in sorted(plan, key=lambda entry: (layer(entry[0]), entry[0]))]


def _data_offsets(writer: gguf.GGUFWriter) -> tuple[dict[str, int], int]:
    """Where each tensor's data starts after the start of the data section, and where the section ends (each
    tensor padded to the alignment, as `GGUFWriter.write_ti_data_to_file` numbers them)."""
    offsets, end = {}, 0
    for name, info in writer.tensors[0].items():
        offsets[name] = end
        end += gguf.GGUFWriter.ggml_pad(info.nbytes, writer.data_alignment)
    return offsets, end
