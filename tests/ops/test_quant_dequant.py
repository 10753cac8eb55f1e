"""The torch reference dequantization of GGUF tensor types against gguf-py's numpy dequantizers."""

import zlib

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant import FORMATS, GGUF_TYPES, dequantize, format_of, row_bytes

HALF_FIELDS = ("d", "dmin", "m")  # the float16 fields of the quantized types
# the types gguf-py's numpy code dequantizes (0.19 has no Q1_0: tested by hand below)
GGUF_DEQUANTIZED = [t for t in GGUF_TYPES if t in ("F32", "F16", "BF16") or hasattr(gguf_quants, t)]
BLOCK_SHAPES = {  # leading dims, blocks per row
    "one block": ((), 1),
    "one row": ((), 5),
    "matrix": ((7,), 4),
    "leading dims": ((2, 3), 2),
}


def random_blocks(qtype: str, leading: tuple[int, ...], n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes [*leading, n_blocks * type_size], each float16 field a random finite value (no NaN/Inf).

    The float16 fields (and IQ1_M's float16 scale, spread over its scale words) keep their random sign, exponent
    and mantissa, subnormals included; only the all-ones exponent is moved down. F32 and BF16 keep every pattern,
    NaNs included: they only widen.
    """
    fmt = format_of(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(*leading, n_blocks, fmt.type_size), dtype=np.uint8)
    offset = 0
    for name, n_bytes in fmt.fields:
        if name in HALF_FIELDS or qtype == "F16":
            half = blocks[..., offset : offset + n_bytes].copy().view(np.uint16)
            half = np.where((half & 0x7C00) == 0x7C00, half & np.uint16(0xBFFF), half)
            blocks[..., offset : offset + n_bytes] = half.view(np.uint8)
        if name == "scales" and qtype == "IQ1_M":  # its float16 scale is the top nibbles of these four words
            words = blocks[..., offset : offset + n_bytes].copy().view(np.uint16)
            d = (
                (words[..., 0] >> 12)
                | ((words[..., 1] >> 8) & 0xF0)
                | ((words[..., 2] >> 4) & 0xF00)
                | (words[..., 3] & 0xF000)
            )
            words[..., 3] = np.where((d & 0x7C00) == 0x7C00, words[..., 3] & np.uint16(0xBFFF), words[..., 3])
            blocks[..., offset : offset + n_bytes] = words.view(np.uint8)
        offset += n_bytes
    return blocks.reshape(*leading, n_blocks * fmt.type_size)


def gguf_reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4's largest scale times 12 overflows to inf, as in ggml
        return gguf_dequantize(raw, GGMLQuantizationType[qtype])


def assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    mismatches = np.flatnonzero(actual.view(np.int32) != expected.view(np.int32))
    assert mismatches.size == 0, f"{mismatches.size} elements differ, first at flat index {mismatches[0]}"


def test_formats_match_ggml_sizes():
    for name in GGUF_TYPES:
        fmt = FORMATS[name]
        assert fmt.name == name
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert {name for name, fmt in FORMATS.items() if fmt.is_float} == {"F32", "F16", "BF16"}


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
@pytest.mark.parametrize("qtype", GGUF_DEQUANTIZED)
def test_dequantize_matches_gguf_bit_for_bit(qtype, shape):
    leading, n_blocks = BLOCK_SHAPES[shape]
    raw = random_blocks(qtype, leading, n_blocks, seed=zlib.crc32(f"{qtype}/{shape}".encode()))
    out = dequantize(torch.from_numpy(raw), qtype)
    fmt = format_of(qtype)
    assert out.dtype == torch.float32 and out.shape == (*leading, n_blocks * fmt.block_size)
    assert_bitwise_equal(out.numpy(), gguf_reference(raw, qtype))


@pytest.mark.parametrize("qtype", GGUF_DEQUANTIZED)
def test_many_blocks_match_gguf_bit_for_bit(qtype):
    """Enough blocks that every scale, mask and nibble value occurs many times."""
    raw = random_blocks(qtype, (8,), 2048 // format_of(qtype).block_size * 16, seed=1)
    assert_bitwise_equal(dequantize(torch.from_numpy(raw), qtype).numpy(), gguf_reference(raw, qtype))


def test_gathered_rows_equal_rows_of_the_whole_table():
    table = torch.from_numpy(random_blocks("Q4_K", (10,), 3, seed=2))
    rows = torch.tensor([7, 0, 7, 3])
    assert torch.equal(dequantize(table[rows], "Q4_K"), dequantize(table, "Q4_K")[rows])


def test_q4_0_block_by_hand():
    """d = 0.5; byte j holds element j in its low nibble and element j + 16 in its high nibble, offset by 8."""
    qs = [(15 << 4) | 0] + [(8 << 4) | 9] * 15
    raw = torch.tensor(list(np.float16(0.5).tobytes()) + qs, dtype=torch.uint8)
    expected = [-4.0] + [0.5] * 15 + [3.5] + [0.0] * 15
    assert dequantize(raw, "Q4_0").tolist() == expected


def test_q1_0_block_by_hand():
    """ggml's dequantize_row_q1_0: d = 0.25; value j is +d where bit j % 8 of byte j // 8 is set, else -d."""
    qs = [0b00000101] + [0] * 14 + [0x80]
    raw = torch.tensor(list(np.float16(0.25).tobytes()) + qs, dtype=torch.uint8)
    expected = [0.25, -0.25, 0.25] + [-0.25] * 124 + [0.25]
    assert dequantize(raw, "Q1_0").tolist() == expected


def test_row_bytes():
    assert row_bytes("Q4_K", 5120) == 20 * 144
    assert row_bytes("Q8_0", 64) == 2 * 34
    assert row_bytes("BF16", 3) == 6


def assert_one_sentence(message: str, *contains: str) -> None:
    assert message.endswith(".") and ". " not in message and "\n" not in message
    for text in contains:
        assert text in message


def test_unknown_type_is_one_sentence_listing_the_supported_ones():
    with pytest.raises(DeltaspecError) as error:
        format_of("Q2_0")
    assert_one_sentence(str(error.value), "'Q2_0'", "Q4_K", "IQ4_XS", "IQ2_XXS", "BF16")
    with pytest.raises(DeltaspecError):
        dequantize(torch.zeros(18, dtype=torch.uint8), "Q2_0")


def test_columns_not_a_whole_number_of_blocks_is_one_sentence():
    with pytest.raises(DeltaspecError) as error:
        row_bytes("Q4_K", 100)
    assert_one_sentence(str(error.value), "100", "Q4_K", "256")


def test_bytes_not_a_whole_number_of_blocks_is_one_sentence():
    with pytest.raises(DeltaspecError) as error:
        dequantize(torch.zeros(3, 145, dtype=torch.uint8), "Q4_K")
    assert_one_sentence(str(error.value), "Q4_K", "144", "145")


def test_non_byte_tensor_is_one_sentence():
    with pytest.raises(DeltaspecError) as error:
        dequantize(torch.zeros(34, dtype=torch.int8), "Q8_0")
    assert_one_sentence(str(error.value), "uint8", "torch.int8")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_cuda_matches_cpu_bit_for_bit(qtype):
    raw = torch.from_numpy(random_blocks(qtype, (16,), 4096 // format_of(qtype).block_size * 4, seed=3))
    on_cpu = dequantize(raw, qtype)
    on_cuda = dequantize(raw.cuda(), qtype)
    assert on_cuda.is_cuda
    assert torch.equal(on_cuda.cpu().view(torch.int32), on_cpu.view(torch.int32))
