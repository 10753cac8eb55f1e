"""`quantize`: a float32 weight matrix -> GGUF blocks, byte for byte as llama.cpp's llama-quantize writes them.

llama-quantize calls `ggml_quantize_chunk`, i.e. ggml's `quantize_<type>(src, dst, nrow, n_per_row, imatrix)`
(ggml/src/ggml-quants.c). Without an imatrix those call `quantize_row_<type>_ref` for Q4_0..Q8_0 and the
k-quants, and `quantize_row_iq4_nl_impl` with ntry = 7 for IQ4_NL / IQ4_XS (IQ4_NL's own `_ref` uses
ntry = -1 and is not what llama-quantize writes); with one they call the `quantize_row_<type>_impl`
importance-weighted searches (Q8_0 and the float types ignore it). `importance` is the imatrix entry of the
tensor: one weight per column, the mean of the squared activations that column multiplies.

The per-type code lives in quantize_legacy (32-element types), quantize_kquants (Q2_K..Q6_K) and quantize_iq4;
the shared searches, and the float32 evaluation order that makes them exact, in quantize_search. Everything is
torch on the weight's device, vectorised over blocks; rows are processed in chunks to bound the temporaries.
"""

import torch

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.formats import row_bytes
from deltaspec.ops.quant.fp8 import quantize_fp8_b128
from deltaspec.ops.quant.int4 import quantize_i4_g32, quantize_i4_g128
from deltaspec.ops.quant.quantize_iq4 import quantize_iq4_nl, quantize_iq4_xs
from deltaspec.ops.quant.quantize_kquants import (
    quantize_q2_k,
    quantize_q3_k,
    quantize_q4_k,
    quantize_q5_k,
    quantize_q6_k,
)
from deltaspec.ops.quant.quantize_legacy import (
    quantize_q4_0,
    quantize_q4_1,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q8_0,
)

QUANTIZERS = {
    "Q8_0": quantize_q8_0,
    "Q4_0": quantize_q4_0,
    "Q4_1": quantize_q4_1,
    "Q5_0": quantize_q5_0,
    "Q5_1": quantize_q5_1,
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
    "IQ4_NL": quantize_iq4_nl,
    "IQ4_XS": quantize_iq4_xs,
    "FP8_B128": quantize_fp8_b128,  # deltaspec's FP8 blocks (not a llama.cpp type)
    "I4_G32": quantize_i4_g32,  # deltaspec's int4 W4A16 blocks (not llama.cpp types)
    "I4_G128": quantize_i4_g128,
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED = FLOAT_TYPES + tuple(QUANTIZERS)
CHUNK_ELEMENTS = 1 << 24  # weight elements quantized at a time (the searches hold ~20 float32 copies)


def quantize(weight: torch.Tensor, qtype: str, importance: torch.Tensor | None = None) -> torch.Tensor:
    """weight [rows, cols] (float) -> uint8 [rows, row_bytes(qtype, cols)], as llama-quantize stores it.

    `importance` [cols] (an imatrix entry) switches to ggml's importance-weighted quantizers.
    """
    if qtype not in SUPPORTED:
        raise DeltaspecError(f"Cannot quantize to {qtype!r}; the supported types are {', '.join(SUPPORTED)}.")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise DeltaspecError(
            f"quantize takes a 2-D floating-point weight [rows, cols], not a {weight.dtype} tensor of shape "
            f"{tuple(weight.shape)}."
        )
    rows, cols = weight.shape
    out_bytes = row_bytes(qtype, cols)
    weight = weight.to(torch.float32).contiguous()
    if importance is not None:
        if importance.shape != (cols,):
            raise DeltaspecError(
                f"The importance of a weight with {cols} columns must have shape ({cols},), "
                f"not {tuple(importance.shape)}."
            )
        importance = importance.to(device=weight.device, dtype=torch.float32)
        if not bool(torch.isfinite(importance).all()):
            raise DeltaspecError("The importance (imatrix) contains NaN or infinite values.")
    if qtype in FLOAT_TYPES:
        return _float_bytes(weight, qtype)
    if not bool(torch.isfinite(weight).all()):
        raise DeltaspecError(f"Cannot quantize a weight containing NaN or infinite values to {qtype}.")
    out = torch.empty(rows, out_bytes, dtype=torch.uint8, device=weight.device)
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        out[start : start + step] = QUANTIZERS[qtype](weight[start : start + step], importance)
    return out


def _float_bytes(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """F32 / F16 / BF16 rows as ggml_quantize_chunk writes them: [rows, cols] -> uint8 [rows, cols * size]."""
    rows = weight.shape[0]
    if qtype == "F32":
        return weight.clone().view(torch.uint8).reshape(rows, -1)
    if qtype == "F16":
        return weight.to(torch.float16).view(torch.uint8).reshape(rows, -1)
    # ggml_compute_fp32_to_bf16: round to nearest even; a NaN keeps its top bits and is made quiet.
    u = weight.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).to(torch.uint8).reshape(rows, -1)
