"""The Triton products from GGUF blocks against their reference (dequantize, then one GEMM): Q8_0, Q4_K, Q6_K,
FP8_B128 and int4 group (I4_G32, I4_G128) weights, 1 to 64 rows, every kernel family with one split and several,
the GEMV's blocks of rows, a permuted input order, one or several segments of different types, row counts and
widths that leave tiles partly empty; more rows or other types take the dequantizing path."""

import pytest
import torch

from deltaspec.ops.quant import format_of
from deltaspec.ops.quant.quantize import quantize
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.quant.weight import quantized_linear as reference_linear
from tests.conftest import skip_if_interpreted

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

HALF_FIELDS = ("d", "dmin")
INT4_TYPES = ("I4_G32", "I4_G128")


def random_weight(qtype: str, rows: int, columns: int, seed: int) -> torch.Tensor:
    """Random blocks [rows, row_bytes] of `qtype` whose float16 scales are small (values of order 1); FP8_B128
    blocks quantized from normal values (random bytes would hold e4m3 NaNs); int4 groups as `random_int4`."""
    fmt = format_of(qtype)
    gen = torch.Generator().manual_seed(seed)
    if qtype == "FP8_B128":
        return quantize(torch.randn(rows, columns, generator=gen), qtype)
    if qtype in INT4_TYPES:
        return random_int4(qtype, rows, columns, gen)
    n_blocks = columns // fmt.block_size
    blocks = torch.randint(0, 256, (rows, n_blocks, fmt.type_size), generator=gen, dtype=torch.uint8)
    offset = 0
    for name, size in fmt.fields:
        if name in HALF_FIELDS:
            scale = (torch.rand(rows, n_blocks, 1, generator=gen) * 0.02 - 0.01).to(torch.float16)
            blocks[..., offset : offset + size] = scale.view(torch.uint8)
        offset += size
    return blocks.reshape(rows, n_blocks * fmt.type_size)


def random_int4(qtype: str, rows: int, columns: int, gen: torch.Generator) -> torch.Tensor:
    """int4 group blocks [rows, row_bytes] quantized from normal values (symmetric, bfloat16 scales), then with
    random zero points z' in 0..16 and, in about half the blocks, a float16 scale in [-0.5, 0.5) instead."""
    fmt = format_of(qtype)
    n_blocks = columns // fmt.block_size
    blocks = quantize(torch.randn(rows, columns, generator=gen), qtype).view(rows, n_blocks, fmt.type_size)
    blocks[..., 2] = torch.randint(0, 17, (rows, n_blocks), generator=gen, dtype=torch.uint8)
    is_half = torch.rand(rows, n_blocks, generator=gen) < 0.5  # [rows, n_blocks]
    half_scale = (torch.rand(rows, n_blocks, 1, generator=gen) - 0.5).to(torch.float16).view(torch.uint8)
    blocks[..., :2] = torch.where(is_half[..., None], half_scale, blocks[..., :2])
    blocks[..., 3] = is_half.to(torch.uint8)
    return blocks.view(rows, n_blocks * fmt.type_size)


def assert_near_the_reference(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    """`got` against the float64 product of the dequantized weights, within a bound relative to the output's
    largest magnitude: float32 kernels stay within 2e-6 of it (the float32 reference itself is off by up to
    about 4e-7 with these sums of hundreds of terms), bf16 ones within 2e-2 and float16 ones within 2e-3 (they
    round the weights, the activations' products and the output)."""
    expected = reference_linear(x.cpu().double(), weight.to("cpu"))
    scale = expected.abs().max().item()
    bound = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(got.dtype, 2e-6)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=bound, atol=bound * scale)


@pytest.fixture
def kernel(kernel_device):
    from deltaspec.ops.triton.quant_matmul import quantized_linear

    return quantized_linear


FAMILIES = [("Q8_0", "gemv"), ("Q8_0", "tile"), ("Q4_K", "gemv"), ("Q4_K", "tile"), ("Q6_K", "gemv"), ("Q6_K", "tile")]
FAMILIES += [("FP8_B128", "gemv"), ("FP8_B128", "tile")]
GRID = [(qtype, family, rows, split_k, paired) for qtype, family in FAMILIES for rows in (1, 3, 16)
        for split_k, paired in ((1, True), (2, False), (3, True))]  # fmt: skip
# the int4 types share their kernels' step loop with the others: one row and a tile's 16, one share and two
# uneven ones through a permuted input (the full grid ran compiled on an H200 when they were written)
GRID += [(qtype, family, rows, split_k, paired) for qtype in INT4_TYPES for family in ("gemv", "tile")
         for rows in (1, 16) for split_k, paired in ((1, True), (2, False))]  # fmt: skip


@pytest.mark.parametrize(("qtype", "family", "rows", "split_k", "paired"), GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_family_matches_the_reference(kernel, kernel_device, qtype, family, rows, split_k, paired, dtype):
    """Shares of 1, 2 and 3 super-blocks' worth (3 splits of 3 super-blocks; 2 leaves the last share shorter)."""
    from deltaspec.ops.triton.quant_matmul import Launch

    if family == "gemv" and rows == 16 and dtype == torch.float32:
        skip_if_interpreted("the GEMV family's 16 rows in bfloat16, 1 and 3 rows in float32")
    order = torch.randperm(768, generator=torch.Generator().manual_seed(2)) if split_k == 2 else None
    data = random_weight(qtype, 40, 768, seed=rows)
    weight = QuantizedWeight([(qtype, data)], 768, order).to(kernel_device)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1)).to(kernel_device, dtype)
    got = kernel(x, weight, Launch(family, 16, split_k, paired=paired))
    assert got.dtype == dtype and got.shape == (rows, 40)
    assert_near_the_reference(got, x, weight)


# (rows, rows per program, shares): a block larger than x, one block, several blocks with the last partial
ROW_BLOCKS = [(1, 4, 1), (2, 2, 2), (3, 4, 3), (4, 4, 1), (5, 4, 2), (8, 8, 3), (16, 8, 1)]


@pytest.mark.parametrize(("rows", "m_block", "split_k"), ROW_BLOCKS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "FP8_B128", *INT4_TYPES])
def test_the_gemv_takes_blocks_of_rows(kernel, kernel_device, qtype, rows, m_block, split_k):
    """M_BLOCK rows of x per program (rows past the last of x repeat it and are not stored), 37 weight rows (a
    partial last tile), three super-blocks in one share, two uneven ones (through a permuted input) or three."""
    from deltaspec.ops.triton.quant_matmul import Launch

    order = torch.randperm(768, generator=torch.Generator().manual_seed(2)) if split_k == 2 else None
    weight = QuantizedWeight([(qtype, random_weight(qtype, 37, 768, seed=rows))], 768, order).to(kernel_device)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    got = kernel(x, weight, Launch("gemv", 16, split_k, 2, m_block=m_block))
    assert got.shape == (rows, 37)
    assert_near_the_reference(got, x, weight)


@pytest.mark.parametrize("family", ["gemv", "tile"])
def test_fp8_kernels_take_every_e4m3_byte(kernel, kernel_device, family):
    """Every finite e4m3 byte (both zeros, the subnormals, 448) in FP8_B128 blocks with scales from 2**-12 to 8:
    the one-row product's integer decode and the tile's conversion give the float32 product of the exact values."""
    gen = torch.Generator().manual_seed(5)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    values = finite[torch.randint(0, 254, (24, 1024), generator=gen)]
    values[0, :254] = finite
    scales = 2.0 ** torch.randint(-12, 4, (24, 8), generator=gen).float()
    blocks = torch.cat([scales.view(torch.uint8).view(24, 8, 4), values.view(24, 8, 128)], dim=-1).view(24, -1)
    weight = QuantizedWeight([("FP8_B128", blocks)], 1024).to(kernel_device)
    x = torch.randn(1, 1024, generator=gen).to(kernel_device)
    from deltaspec.ops.triton.quant_matmul import Launch

    got = kernel(x, weight, Launch(family, 8, 2))
    assert_near_the_reference(got, x, weight)


SHARED = [("Q4_K", "gemv", 1, 1), ("I4_G128", "gemv", 1, 1), ("Q6_K", "gemv", 3, 2), ("FP8_B128", "tile", 3, 1)]


@pytest.mark.parametrize(("qtype", "family", "rows", "m_block"), SHARED)
def test_shares_are_added_in_order_by_the_last_to_finish(kernel, kernel_device, qtype, family, rows, m_block):
    """Three shares of one super-block each: the output is, bit for bit, ((p0 + p1) + p2) in float32, p_s being the
    one-share product of x with its columns outside share s zeroed (exact zeros add nothing), whichever share
    finished last; the per-tile arrival counts are back to 0 after each launch, so a second launch (sharing them)
    gives the same bits."""
    from deltaspec.ops.triton import quant_bits, quant_matmul

    weight = QuantizedWeight([(qtype, random_weight(qtype, 40, 768, seed=3))], 768).to(kernel_device)
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(4)).to(kernel_device)
    total = torch.zeros(rows, 40, device=kernel_device)
    for share in range(3):
        masked = torch.zeros_like(x[:rows])
        masked[:, share * 256 : (share + 1) * 256] = x[:rows, share * 256 : (share + 1) * 256]
        total += kernel(masked, weight, quant_matmul.Launch(family, 16, 1, m_block=m_block))
    for _ in range(2):
        assert torch.equal(kernel(x[:rows], weight, quant_matmul.Launch(family, 16, 3, m_block=m_block)), total)
        tiles = quant_bits.arrival_counts(x.device, 4 if m_block == 1 else 8)  # cdiv(40, 16) * row blocks, rounded up
        assert not tiles.any()


ROUTED = [(qtype, rows) for qtype in ("Q8_0", "Q4_K", "Q6_K", "FP8_B128") for rows in (1, 2, 3, 8, 16, 64)]
ROUTED += [(qtype, rows) for qtype in INT4_TYPES for rows in (1, 4, 5, 16, 64)]


@pytest.mark.parametrize(("qtype", "rows"), ROUTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_routed_product_matches_the_reference(kernel, kernel_device, qtype, rows, dtype):
    weight = QuantizedWeight([(qtype, random_weight(qtype, 40, 512, seed=rows))], 512).to(kernel_device)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(kernel_device, dtype)
    got = kernel(x, weight)
    assert got.dtype == dtype and got.shape == (rows, 40)
    assert_near_the_reference(got, x, weight)


def test_segments_of_different_types_and_leading_dims(kernel, kernel_device):
    """A fused projection whose parts differ in type: each segment's product lands in its own output columns."""
    parts = [("Q4_K", random_weight("Q4_K", 24, 256, 1)), ("Q6_K", random_weight("Q6_K", 8, 256, 2))]
    weight = QuantizedWeight([(q, d) for q, d in parts], 256).to(kernel_device)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    got = kernel(x, weight)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, reference_linear(x, weight), rtol=1e-4, atol=1e-4)
    prefill = torch.randn(65, 256, generator=torch.Generator().manual_seed(4)).to(kernel_device)  # dequantized
    torch.testing.assert_close(kernel(prefill, weight), reference_linear(prefill, weight), rtol=1e-4, atol=1e-4)


ONE_PASS_CASES = [(qtype, 512) for qtype in ("Q8_0", "Q4_K", "Q6_K", "FP8_B128", *INT4_TYPES)]
ONE_PASS_CASES += [("Q8_0", 384), ("FP8_B128", 384), ("I4_G32", 384), ("I4_G128", 384), ("I4_G32", 288)]


@pytest.mark.parametrize(("qtype", "columns"), ONE_PASS_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_dequantize_equals_the_reference(kernel_device, qtype, columns, dtype):
    """37 rows (a partial last program), two super-blocks, or one and a part (Q8_0, FP8_B128 and int4 rows of
    384 values, I4_G32 rows of 288, whose last values the kernel leaves to the reference): the same bits as the
    reference, rounded to dtype."""
    from deltaspec.ops.quant.dequant import dequantize as reference_dequantize
    from deltaspec.ops.triton.quant_dequant import dequantize

    if dtype == torch.bfloat16 and kernel_device == "cpu":
        pytest.skip("Triton's interpreter rounds float32 to bfloat16 by truncation, CUDA to nearest")
    data = random_weight(qtype, 37, columns, seed=7).to(kernel_device)
    assert torch.equal(dequantize(data, qtype, dtype), reference_dequantize(data, qtype).to(dtype))


def test_many_rows_and_other_types_take_the_dequantizing_path(kernel, kernel_device):
    from deltaspec.ops.triton.quant_matmul import kernel_handles

    q5 = QuantizedWeight([("Q5_K", random_weight("Q5_K", 8, 256, 4))], 256).to(kernel_device)
    q4 = QuantizedWeight([("Q4_K", random_weight("Q4_K", 8, 256, 5))], 256).to(kernel_device)
    assert not kernel_handles(q5, 1, torch.float32) and not kernel_handles(q4, 65, torch.float32)
    assert kernel_handles(q4, 64, torch.bfloat16) and not kernel_handles(q4, 1, torch.float64)
    x = torch.randn(65, 256, generator=torch.Generator().manual_seed(6)).to(kernel_device)
    torch.testing.assert_close(kernel(x, q4), reference_linear(x, q4))
    torch.testing.assert_close(kernel(x[:2], q5), reference_linear(x[:2], q5))
