"""Q4_K and Q6_K matrices repacked at load time into the layout the CUDA products read (`Q4_K_R`, `Q6_K_R`).

A GGUF file stores a matrix row by row, each row a run of 256-value super-blocks. The CUDA products
(`deltaspec.ops.triton.quant_mma`) want each field of the blocks as its own plane, contiguous along the output
rows, so that a program's loads of a few hundred output rows are whole 128-byte lines:

- Q4_K_R: the nibbles as int32 words [in / 8, out], word 32s + l of a row holding lane l of each of the eight
  32-value sub-blocks of super-block s (byte b: sub-block 2b in the low nibble, 2b + 1 in the high one: the file's
  quant bytes l, 32 + l, 64 + l, 96 + l), so that one masked shift of a word puts four sub-blocks' quants in its
  bytes; then each super-block's four header words (float16 d | dmin, and the 12 bytes of 6-bit scales and mins)
  as int32 [in / 256 * 4, out];
- Q6_K_R: the low nibbles as words [in / 8, out] laid out by lane as Q4_K_R's (the file's ql bytes l, 32 + l,
  64 + l, 96 + l: byte b = 2h + r holds quarter r of half h in its low nibble, quarter 2 + r in its high one), the
  top two bits as words [in / 16, out] (word 16s + l, byte b: lane l's bits of quarters r and 2 + r of half h in
  its low nibble, lane l + 16's in its high one), the int8 scales [in / 16, out] and the float16 d [in / 256, out].

The planes are one uint8 buffer of the original's size, kept as [out, row_bytes] so that a `QuantizedWeight`
holding it keeps its shape and byte count; only whole 2-D matrices are repacked, and the repacking is a
permutation of the file's bits (`unpack` gives the blocks back, byte for byte).
"""

from __future__ import annotations

import torch

from deltaspec.ops.quant.formats import row_bytes

REPACKED = {"Q4_K": "Q4_K_R", "Q6_K": "Q6_K_R"}  # block type -> its repacked layout
BASE = {layout: qtype for qtype, layout in REPACKED.items()}
PASS_BYTES = 32 << 20  # the input bytes repacked at a time (whole rows), so that a pass's temporaries stay small
# a pass's torch temporaries live at once, per input byte, at most (counted from the steps of `_repack_q4_k`, 1.9,
# and `_repack_q6_k`, 2.7, whose top bits stay bytes; tests/ops/test_kernels_repacked.py checks the bound on CUDA)
TEMPORARIES = {"Q4_K": 2, "Q6_K": 3}


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
        size = shape[0] * shape[1] * dtype.itemsize
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
    per_pass = rows_per_pass(data.shape[1])
    for first in range(0, rows, per_pass):
        last = min(first + per_pass, rows)
        for target, part in zip(targets, split(data[first:last])):
            target[:, first:last] = part
    return out


def rows_per_pass(row_bytes: int) -> int:
    """Rows `repack` takes at a time: `PASS_BYTES` of them, at least one."""
    return max(1, PASS_BYTES // row_bytes)


def transient_bytes(qtype: str, nbytes: int, row_bytes: int) -> int:
    """Memory `repack` holds beyond its input while it repacks a Q4_K or Q6_K matrix of `nbytes` (rows of
    `row_bytes`), at most: the repacked copy, and one pass's temporaries."""
    return nbytes + TEMPORARIES[qtype] * min(nbytes, rows_per_pass(row_bytes) * row_bytes)


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
    lanes = supers[..., :128].reshape(rows, -1, 4, 32).transpose(2, 3).contiguous().view(torch.int32)  # [n, S, 32]
    qh = supers[..., 128:192].reshape(rows, -1, 2, 1, 32)  # [n, S, half h, 1, lane], bytes throughout
    r = torch.arange(2, device=blocks.device, dtype=torch.uint8)[:, None]
    bits = ((qh >> (2 * r)) & 3) | (((qh >> (4 + 2 * r)) & 3) << 2)  # [n, S, h, r, lane]: quarters r and 2 + r
    bits = bits.reshape(rows, -1, 4, 2, 16)  # byte b = 2h + r; lanes l and l + 16
    packed = (bits[..., 0, :] | (bits[..., 1, :] << 4)).transpose(2, 3).contiguous()  # [n, S, 16, 4]
    scales = supers[..., 192:208].reshape(rows, -1).t().view(torch.int8)
    d = supers[..., 208:].contiguous().view(torch.int16).reshape(rows, -1).t()
    return lanes.reshape(rows, -1).t(), packed.view(torch.int32).reshape(rows, -1).t(), scales, d


def _unpack_q6_k(words, high_words, scales, d) -> torch.Tensor:
    rows = words.shape[1]
    ql = words.t().contiguous().view(torch.uint8).reshape(rows, -1, 32, 4).transpose(2, 3).reshape(rows, -1, 128)
    packed = high_words.t().contiguous().view(torch.uint8).reshape(rows, -1, 16, 4).transpose(2, 3).to(torch.int32)
    bits = torch.stack((packed & 0xF, packed >> 4), dim=3).reshape(rows, -1, 2, 2, 32)  # [n, S, h, r, lane]
    r = torch.arange(2, device=words.device, dtype=torch.int32)[:, None]
    qh = (((bits & 3) << (2 * r)) | (((bits >> 2) & 3) << (4 + 2 * r))).sum(dim=3)  # [n, S, h, lane]
    scale_bytes = scales.t().flatten().view(torch.uint8).reshape(rows, -1, 16)
    d_bytes = d.t().flatten().view(torch.uint8).reshape(rows, -1, 2)
    qh = qh.to(torch.uint8).reshape(rows, -1, 64)
    return torch.cat((ql, qh, scale_bytes, d_bytes), dim=-1).reshape(rows, -1)
