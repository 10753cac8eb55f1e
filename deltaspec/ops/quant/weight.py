"""`QuantizedWeight`: a weight matrix kept in memory as GGUF blocks, and its reference product.

A matrix [out, in] is stored by rows: each row is `in / block_size` blocks of its tensor type. A fused
projection (q | k | v, gate | up, the GDN input projections) stacks the rows of its parts, which may be of
different types (llama.cpp's mixes give `attn_v` more bits than `attn_q`), so a weight is a list of row
*segments*, each one type: data uint8 [rows, row_bytes], or [experts, rows, row_bytes] for the routed
experts of a MoE layer, where `weight[e]` is expert e's matrix. Float parts (F32 / F16 / BF16 tensors of a
GGUF file) are segments too, stored as their raw bytes. `input_order` [in] (or None) says which input feature
each stored column multiplies, for a matrix whose columns the file keeps permuted (a quantized Qwen3.5
`out_proj`, whose blocks span several value heads): products first gather the input's features in that order.

On CUDA the engine repacks the Q4_K and Q6_K segments of 2-D matrices into the layouts its products read
(`repack_for_kernels`, `deltaspec.ops.quant.repacked`): the same bytes, kept as planes across the segment.

The reference product dequantizes the whole matrix per use (`deltaspec.ops.quant.dequant`, the spec of
every kernel) and multiplies in the activations' dtype; embeddings gather and dequantize only the rows
they need. The CUDA backend registers kernels that read the blocks directly under the same contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant import repacked
from deltaspec.ops.quant.dequant import dequantize
from deltaspec.ops.quant.formats import row_bytes

FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class QuantizedWeight(nn.Module):
    """A [out, in] (or [experts, out, in]) weight as row segments of GGUF blocks."""

    def __init__(
        self, segments: list[tuple[str, torch.Tensor]], in_features: int, input_order: torch.Tensor | None = None
    ):
        super().__init__()
        if not segments:
            raise ValueError("a quantized weight needs at least one segment")
        self.qtypes = tuple(qtype for qtype, _ in segments)
        self.in_features = in_features
        lead = segments[0][1].shape[:-2]
        for i, (qtype, data) in enumerate(segments):
            expected = row_bytes(qtype, in_features)
            if data.dtype != torch.uint8 or data.shape[-1] != expected or data.shape[:-2] != lead:
                raise DeltaspecError(
                    f"A {qtype} weight part of shape {tuple(data.shape)} does not hold rows of {in_features} values "
                    f"({expected} bytes each); the file's tensor is damaged or of another shape."
                )
            self.register_buffer(f"segment{i}", data, persistent=False)
        self.register_buffer("input_order", input_order, persistent=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, input_order: torch.Tensor | None = None) -> QuantizedWeight:
        """A float matrix as one segment of its own type (F32, F16 or BF16), bytes unchanged, or with its columns
        stored in `input_order` (to join blocks that read their input so)."""
        qtype = FLOAT_TYPES.get(weight.dtype)
        if qtype is None:
            raise DeltaspecError(f"A {weight.dtype} weight cannot join a quantized one; use float32, float16 or bf16.")
        if input_order is not None:
            weight = weight.index_select(-1, input_order)
        rows = weight.contiguous().view(torch.uint8)  # [..., out, in * itemsize]
        return cls([(qtype, rows)], weight.shape[-1], input_order)

    @property
    def segments(self) -> list[tuple[str, torch.Tensor]]:
        return [(qtype, getattr(self, f"segment{i}")) for i, qtype in enumerate(self.qtypes)]

    @property
    def block_segments(self) -> list[tuple[str, torch.Tensor]]:
        """`segments` with repacked ones (`repack_for_kernels`) given back as the file's blocks."""
        return [
            (repacked.BASE[qtype], repacked.unpack(data, qtype, self.in_features))
            if qtype in repacked.BASE
            else (qtype, data)
            for qtype, data in self.segments
        ]

    @property
    def shape(self) -> torch.Size:
        data = self.segments[0][1]
        return torch.Size((*data.shape[:-2], sum(d.shape[-2] for _, d in self.segments), self.in_features))

    @property
    def device(self) -> torch.device:
        return self.segments[0][1].device

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.segments)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored float matrix ([..., out, in], columns in `input_order` if it has one): each segment
        dequantized in float32, then cast to `dtype`."""
        parts = [dequantize(data, qtype) for qtype, data in self.segments]
        return torch.cat(parts, dim=-2).to(dtype)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix [..., out, in] with its columns in input order: `dequantize`'s stored columns put back where
        `input_order` took them."""
        stored = self.dequantize(dtype)
        if self.input_order is None:
            return stored
        return stored.index_select(-1, torch.argsort(self.input_order))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [N] of a single-segment matrix, dequantized: [N, in] (an embedding lookup)."""
        (qtype, data), *rest = self.block_segments
        if rest or data.dim() != 2:
            raise ValueError("row lookup needs a 2-D weight of one segment")
        return dequantize(data[ids], qtype).to(dtype)

    def repack_for_kernels(self) -> int:
        """Repack this matrix's Q4_K and Q6_K segments in place into the layouts of the CUDA products (a 2-D
        matrix only; an expert stack keeps its blocks). Returns how many segments were repacked."""
        done = 0
        for i, (qtype, data) in enumerate(self.segments):
            if qtype in repacked.REPACKED and data.dim() == 2:
                setattr(self, f"segment{i}", repacked.repack(data, qtype))
                done += 1
        self.qtypes = tuple(repacked.REPACKED.get(q, q) if d.dim() == 2 else q for q, d in self.segments)
        return done

    def ordered_input(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [..., in] with its features in the order the stored columns take them."""
        return x if self.input_order is None else x.index_select(-1, self.input_order)

    def __getitem__(self, expert: int) -> QuantizedWeight:
        """Expert `expert`'s matrix of an [experts, out, in] weight."""
        segments = [(qtype, data[expert]) for qtype, data in self.segments]
        return QuantizedWeight(segments, self.in_features, self.input_order)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `parts` stacked ([sum(out), in]); adjacent segments of one type are merged. The parts read
        their input in one order (`shared_order`)."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("stacked weights must read inputs of one size")
        order = shared_order(parts)
        merged: list[tuple[str, torch.Tensor]] = []
        for qtype, data in (segment for part in parts for segment in part.block_segments):
            if merged and merged[-1][0] == qtype:
                merged[-1] = (qtype, torch.cat([merged[-1][1], data], dim=-2))
            else:
                merged.append((qtype, data))
        return cls(merged, parts[0].in_features, order)

    def split(self, sizes: list[int]) -> list[QuantizedWeight]:
        """The inverse of `cat`: consecutive row ranges of `sizes` rows (a range may span segments)."""
        out, rows = [], self.block_segments
        for size in sizes:
            taken: list[tuple[str, torch.Tensor]] = []
            while size:
                qtype, data = rows[0]
                n = min(size, data.shape[-2])
                taken.append((qtype, data[..., :n, :]))
                rows[0] = (qtype, data[..., n:, :])
                if rows[0][1].shape[-2] == 0:
                    rows.pop(0)
                size -= n
            out.append(QuantizedWeight(taken, self.in_features, self.input_order))
        return out

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, types={'+'.join(self.qtypes)}, bytes={self.nbytes}"


def shared_order(parts: list[QuantizedWeight]) -> torch.Tensor | None:
    """The input order all `parts` read their input in (None: as it comes), refused where they differ."""
    orders = [p.input_order for p in parts]
    first = orders[0]
    if any((o is None) != (first is None) or (o is not None and not torch.equal(o, first)) for o in orders):
        raise DeltaspecError(
            "Projections of one input that deltaspec multiplies as one weight are quantized in different activation "
            "orders; it loads checkpoints whose projections of one input share their order (GPTQ gives them one)."
        )
    return first


def block_types(model: nn.Module) -> list[str]:
    """The GGUF block types of the weights `model` keeps quantized (empty for a float model)."""
    return sorted({qtype for m in model.modules() if isinstance(m, QuantizedWeight) for qtype in m.qtypes})


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]), the reference: the matrix dequantized, then one GEMM in x's dtype."""
    return F.linear(weight.ordered_input(x), weight.dequantize(x.dtype))
