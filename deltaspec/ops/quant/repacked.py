"""Q4_K and Q6_K matrices repacked at load time into the layout the CUDA products read (`Q4_K_R`, `Q6_K_R`).

A GGUF file stores a matrix row by row, each row a run of 256-value super-blocks. The CUDA products
(`deltaspec.ops.triton.quant_mma`) want each field of the blocks as its own plane, contiguous along the output
rows, so that a program's loads of a few hundred output rows are whole 128-byte lines and the nibbles of a
sub-block arrive as four int32 words per row:

- Q4_K_R: the nibbles as int32 words [in / 8, out] (word w of row n holds values 8w .. 8w + 7 of that row,
  nibble i value 8w + i), then each super-block's four header words (float16 d | dmin, and the 12 bytes of 6-bit
  scales and mins) as int32 [in / 256 * 4, out];
- Q6_K_R: the low nibbles as int32 words [in / 8, out] (word w holds values 8w .. 8w + 7, nibble i value
  8w + i), the top two bits as int32 words [in / 16, out] (value 16w + i at
  bits 2i), the int8 scales [in / 16, out] and the float16 d [in / 256, out].

The planes are one uint8 buffer of the original's size, kept as [out, row_bytes] so that a `QuantizedWeight`
holding it keeps its shape and byte count; only whole 2-D matrices are repacked, and the repacking is a
permutation of the file's bits (`unpack` gives the blocks back, byte for byte).
"""

from __future__ import annotations

import torch

from deltaspec.ops.quant.formats import row_bytes

REPACKED = {"Q4_K": "Q4_K_R", "Q6_K": "Q6_K_R"}  # block type -> its repacked layout
BASE = {layout: qtype for qtype, layout in REPACKED.items()}
ROWS_PER_PASS = 4096  # output rows repacked at a time, so that the int32 temporaries stay a few hundred MB


def plane_shapes(layout: str, rows: int, columns: int) -> tuple[tuple[torch.dtype, tuple[int, int]], ...]:
    """The planes of a `layout` matrix [rows, columns]: (dtype, shape) in buffer order."""
    if layout == "Q4_K_R":
        return (torch.int32, (columns // 8, rows)), (torch.int32, (columns // 256 * 4, rows))
    return (
        (torch.int32, (columns // 8, rows)),
        (torch.int32, (columns // 16, rows)),
        (torch.int8, (columns // 16, rows)),
        (torch.int16, (columns // 256, rows)),
    )


def planes(data: torch.Tensor, layout: str, columns: int) -> tuple[torch.Tensor, ...]:
    """Views of the planes of a repacked buffer `data` [rows, row_bytes] of a [rows, columns] matrix."""
    flat = data.reshape(-1)
    views, at = [], 0
    for dtype, shape in plane_shapes(layout, data.shape[0], columns):
        size = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
        views.append(flat[at : at + size].view(dtype).view(shape))
        at += size
    return tuple(views)


def repack(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """Q4_K or Q6_K blocks [rows, row_bytes] -> the repacked buffer [rows, row_bytes] (uint8, same device)."""
    rows = data.shape[0]
    columns = data.shape[1] // format_bytes(qtype) * 256
    out = torch.empty_like(data)
    targets = planes(out, REPACKED[qtype], columns)
    split = _repack_q4_k if qtype == "Q4_K" else _repack_q6_k
    for first in range(0, rows, ROWS_PER_PASS):
        last = min(first + ROWS_PER_PASS, rows)
        for target, part in zip(targets, split(data[first:last])):
            target[:, first:last] = part
    return out


def unpack(data: torch.Tensor, layout: str, columns: int) -> torch.Tensor:
    """The blocks [rows, row_bytes] of type BASE[layout] that `repack` took apart."""
    parts = planes(data, layout, columns)
    return _unpack_q4_k(*parts) if layout == "Q4_K_R" else _unpack_q6_k(*parts)


def format_bytes(qtype: str) -> int:
    """Bytes of one 256-value super-block of `qtype` (or of its repacked layout)."""
    return row_bytes(BASE.get(qtype, qtype), 256)


def _repack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K rows [n, S * 144] -> (nibble words [S * 32, n], header words [S * 4, n])."""
    rows = blocks.shape[0]
    supers = blocks.reshape(rows, -1, 144)
    heads = supers[..., :16].contiguous().view(torch.int32)  # [n, S, 4]
    lanes = supers[..., 16:].reshape(rows, -1, 4, 32).transpose(2, 3).contiguous().view(torch.int32)  # [n, S, 32]
    return lanes.reshape(rows, -1).t(), heads.permute(1, 2, 0).reshape(-1, rows)


def _unpack_q4_k(words: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    rows = words.shape[1]
    qs = words.t().contiguous().view(torch.uint8).reshape(rows, -1, 32, 4).transpose(2, 3).reshape(rows, -1, 128)
    head_bytes = heads.reshape(-1, 4, rows).permute(2, 0, 1).contiguous().view(torch.uint8)  # [n, S, 16]
    return torch.cat((head_bytes, qs), dim=-1).reshape(rows, -1)


def _repack_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K rows [n, S * 210] -> (low-nibble words, top-bit words, scales, d) as `plane_shapes` gives them."""
    rows = blocks.shape[0]
    supers = blocks.reshape(rows, -1, 210)
    ql = supers[..., :128].reshape(rows, -1, 2, 2, 32).to(torch.int32)  # [n, S, half, quarter % 2, l]
    qh = supers[..., 128:192].reshape(rows, -1, 2, 1, 32).to(torch.int32)  # [n, S, half, 1, l]
    low = torch.stack((ql & 0xF, ql >> 4), dim=3)  # [n, S, half, nibble, quarter % 2, l]: quarter = 2 nibble + q % 2
    high = (qh >> (2 * torch.arange(4, device=blocks.device, dtype=torch.int32))[:, None]) & 3  # [n, S, 2, 4, 32]
    scales = supers[..., 192:208].reshape(rows, -1).t().view(torch.int8)
    d = supers[..., 208:].contiguous().view(torch.int16).reshape(rows, -1).t()
    return _pack_fields(low.reshape(rows, -1, 8), 4), _pack_fields(high.reshape(rows, -1, 16), 2), scales, d


def _unpack_q6_k(words, high_words, scales, d) -> torch.Tensor:
    rows = words.shape[1]
    low = _unpack_fields(words, 4).reshape(rows, -1, 2, 2, 2, 32)  # [n, S, half, nibble, quarter % 2, l]
    high = _unpack_fields(high_words, 2).reshape(rows, -1, 2, 4, 32)  # [n, S, half, quarter, l]
    ql = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, -1, 128)
    shifts = (2 * torch.arange(4, device=words.device, dtype=torch.int32))[:, None]
    qh = (high << shifts).sum(dim=3).reshape(rows, -1, 64)
    scale_bytes = scales.t().flatten().view(torch.uint8).reshape(rows, -1, 16)
    d_bytes = d.t().flatten().view(torch.uint8).reshape(rows, -1, 2)
    return torch.cat((ql.to(torch.uint8), qh.to(torch.uint8), scale_bytes, d_bytes), dim=-1).reshape(rows, -1)


def _pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, words, 32 / bits] small ints -> int32 words [words, n], field i at bits i * bits."""
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int32)
    words = (values << shifts).sum(dim=-1, dtype=torch.int64).to(torch.int32)  # bit 31 wraps to the int32's sign
    return words.t()


def _unpack_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """`_pack_fields` undone: int32 words [words, n] -> [n, words, 32 / bits]."""
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    return (words.t()[..., None] >> shifts) & ((1 << bits) - 1)
