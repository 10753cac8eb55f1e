"""The GGUF tensor types deltaspec reads, and its own block type for FP8 checkpoints: each one's block size and
byte layout.

A quantized row is a run of blocks; a block packs `block_size` elements into `type_size` bytes,
laid out as the fields of ggml's `block_*` struct (ggml/src/ggml-common.h), in struct order and
without padding. The float types are blocks of one element. Names are spelled as gguf spells them.
Fields named `d`, `dmin` or `m` hold one little-endian float16 each (two bytes); `e` (MXFP4) is an
E8M0 exponent byte; every other field is packed quants, codebook indices, signs or packed sub-block scales (IQ1_M
keeps its float16 scale in the top nibbles of `scales`). The codebook and ternary types are dequantized by
`deltaspec.ops.quant.dequant_iq`.

`FP8_B128` is not a GGUF type: it is how deltaspec keeps the weights of a Hugging Face FP8 checkpoint (float8
e4m3 values, one float32 scale per 128 x 128 tile): each run of 128 values of a row as a block of its tile's
float32 `scale` (the checkpoint's `weight_scale_inv`, repeated on each of the tile's rows: 4 bytes per 128
values) and the 128 e4m3 bytes, so that the row segments, fusions, shards and expert stacks of GGUF weights
hold it unchanged. `I4_G32` and `I4_G128` are its blocks for the int4 W4A16 checkpoints (compressed-tensors,
GPTQ): one group's bfloat16 or float16 scale, zero point and nibbles (`deltaspec.ops.quant.int4`). `Q4_K_R` and
`Q6_K_R` are a whole Q4_K or Q6_K matrix repacked for the CUDA products (`deltaspec.ops.quant.repacked`): the
same bytes per row, but kept as planes across the matrix, so they are not a run of blocks per row.
"""

from dataclasses import dataclass

from deltaspec.errors import DeltaspecError

QK_K = 256  # elements per k-quant super-block (and IQ4_XS block)


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF tensor type: `block_size` elements stored as the byte `fields` of one block."""

    name: str
    block_size: int
    fields: tuple[tuple[str, int], ...]  # (field name, bytes), in struct order
    is_float: bool = False
    in_gguf: bool = True  # a ggml type (FP8_B128, I4_G32 and I4_G128 are deltaspec's own)

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return sum(n_bytes for _, n_bytes in self.fields)


_ALL = (
    QuantFormat("F32", 1, (("value", 4),), is_float=True),
    QuantFormat("F16", 1, (("value", 2),), is_float=True),
    QuantFormat("BF16", 1, (("value", 2),), is_float=True),
    QuantFormat("Q8_0", 32, (("d", 2), ("qs", 32))),
    QuantFormat("Q4_0", 32, (("d", 2), ("qs", 16))),
    QuantFormat("Q4_1", 32, (("d", 2), ("m", 2), ("qs", 16))),
    QuantFormat("Q5_0", 32, (("d", 2), ("qh", 4), ("qs", 16))),
    QuantFormat("Q5_1", 32, (("d", 2), ("m", 2), ("qh", 4), ("qs", 16))),
    QuantFormat("Q2_K", QK_K, (("scales", QK_K // 16), ("qs", QK_K // 4), ("d", 2), ("dmin", 2))),
    QuantFormat("Q3_K", QK_K, (("hmask", QK_K // 8), ("qs", QK_K // 4), ("scales", 12), ("d", 2))),
    QuantFormat("Q4_K", QK_K, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", QK_K // 2))),
    QuantFormat("Q5_K", QK_K, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", QK_K // 8), ("qs", QK_K // 2))),
    QuantFormat("Q6_K", QK_K, (("ql", QK_K // 2), ("qh", QK_K // 4), ("scales", QK_K // 16), ("d", 2))),
    QuantFormat("IQ4_NL", 32, (("d", 2), ("qs", 16))),
    QuantFormat("IQ4_XS", QK_K, (("d", 2), ("scales_h", 2), ("scales_l", QK_K // 64), ("qs", QK_K // 2))),
    QuantFormat("MXFP4", 32, (("e", 1), ("qs", 16))),
    QuantFormat("IQ2_XXS", QK_K, (("d", 2), ("qs", QK_K // 4))),
    QuantFormat("IQ2_XS", QK_K, (("d", 2), ("qs", QK_K // 4), ("scales", QK_K // 32))),
    QuantFormat("IQ2_S", QK_K, (("d", 2), ("qs", QK_K // 4), ("qh", QK_K // 32), ("scales", QK_K // 32))),
    QuantFormat("IQ3_XXS", QK_K, (("d", 2), ("qs", 3 * QK_K // 8))),
    QuantFormat("IQ3_S", QK_K, (("d", 2), ("qs", QK_K // 4), ("qh", QK_K // 32), ("signs", QK_K // 8), ("scales", 4))),
    QuantFormat("IQ1_S", QK_K, (("d", 2), ("qs", QK_K // 8), ("qh", QK_K // 16))),
    QuantFormat("IQ1_M", QK_K, (("qs", QK_K // 8), ("qh", QK_K // 16), ("scales", QK_K // 32))),
    QuantFormat("TQ1_0", QK_K, (("qs", (QK_K - 4 * QK_K // 64) // 5), ("qh", QK_K // 64), ("d", 2))),
    QuantFormat("TQ2_0", QK_K, (("qs", QK_K // 4), ("d", 2))),
    QuantFormat("Q1_0", 128, (("d", 2), ("qs", 16))),
    QuantFormat("FP8_B128", 128, (("scale", 4), ("qs", 128)), in_gguf=False),
    QuantFormat("I4_G32", 32, (("scale", 2), ("zero", 1), ("scale_type", 1), ("qs", 16)), in_gguf=False),
    QuantFormat("I4_G128", 128, (("scale", 2), ("zero", 1), ("scale_type", 1), ("qs", 64)), in_gguf=False),
    QuantFormat("Q4_K_R", QK_K, (("planes", 144),), in_gguf=False),
    QuantFormat("Q6_K_R", QK_K, (("planes", 210),), in_gguf=False),
)

FORMATS: dict[str, QuantFormat] = {fmt.name: fmt for fmt in _ALL}
GGUF_TYPES = tuple(name for name, fmt in FORMATS.items() if fmt.in_gguf)


def format_of(name: str) -> QuantFormat:
    """The format called `name` (as gguf spells it, e.g. "Q4_K")."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise DeltaspecError(
            f"GGUF tensor type {name!r} is not supported; the supported types are {', '.join(FORMATS)}."
        )
    return fmt


def row_bytes(name: str, columns: int) -> int:
    """Bytes of one row of `columns` elements of type `name`."""
    fmt = format_of(name)
    if columns % fmt.block_size != 0:
        raise DeltaspecError(
            f"A row of {columns} elements cannot be stored as {name}, whose blocks hold {fmt.block_size} elements each."
        )
    return columns // fmt.block_size * fmt.type_size
