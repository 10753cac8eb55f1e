"""GGUF quantized weights: the tensor types' formats and their torch reference dequantization."""

from deltaspec.ops.quant.dequant import dequantize
from deltaspec.ops.quant.formats import FORMATS, GGUF_TYPES, QuantFormat, format_of, row_bytes

__all__ = ["FORMATS", "GGUF_TYPES", "QuantFormat", "dequantize", "format_of", "row_bytes"]
