"""`--fp8-activations dynamic`: FP8 weights' products of more than 64 rows with activations quantized to e4m3 per
token and 128 features (W8A8). The reference's arithmetic (quantization, float32 accumulation of the dequantized
operands), the products of up to 64 rows unchanged, the option through the engine (prefill changes, greedy
speculation stays exact, a bad value refused in a sentence); the Triton quantization and block split bit for bit
as the reference (also interpreted), and on the GPU cuBLAS's block-scaled FP8 product and the engine's CUDA path
against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaspec import LLM, SamplingParams
from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant import dequantize
from deltaspec.ops.quant import w8a8 as reference
from deltaspec.ops.quant.fp8 import quantize_fp8_b128
from deltaspec.ops.quant.weight import QuantizedWeight, quantized_linear
from tests.conftest import triton_interpreted
from tests.tiny_models import FP8_DIMS, write_checkpoint, write_fp8_checkpoint

OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=2, max_model_len=256)
LONG_PROMPT = [(7 * i) % 250 + 3 for i in range(200)]  # prefilled as 136 rows, then the last 64 (a checkpoint)


def fp8_weight(rows: list[int], columns: int, float_rows: int = 0, seed: int = 0) -> QuantizedWeight:
    """FP8_B128 segments of `rows` rows each (row-wise block scales, as `--quant fp8` quantizes), then a bf16
    float segment of `float_rows` rows, all reading `columns` inputs."""
    generator = torch.Generator().manual_seed(seed)
    parts = [
        QuantizedWeight([("FP8_B128", quantize_fp8_b128(torch.randn(n, columns, generator=generator), None))], columns)
        for n in rows
    ]
    if float_rows:
        parts.append(QuantizedWeight.from_float(torch.randn(float_rows, columns, generator=generator).bfloat16()))
    segments = [segment for part in parts for segment in part.segments]  # kept apart, as differing widths need
    return QuantizedWeight(segments, columns)


def wide_range_activations(rows: int, columns: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Values over nine decades (so runs hold e4m3 subnormals), an all-zero run and a run with one huge value."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, columns, generator=generator) * torch.logspace(-6, 3, columns)
    x[1 % rows, :128] = 0
    x[2 % rows, 128] = 3e4
    return x.to(device=device, dtype=dtype)


def test_activations_quantize_per_token_and_128_features():
    x = wide_range_activations(5, 384, torch.float32)
    values, scales = reference.quantize_activations(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 3)
    runs = x.view(5, 3, 128)
    amax = runs.abs().amax(-1)
    assert torch.equal(scales, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    assert torch.equal(values.float().view(5, 3, 128).abs().amax(-1), torch.where(amax > 0, 448.0, 0.0))
    back = reference.dequantize_activations(values, scales, torch.float64).view(5, 3, 128)
    error = (back - runs.double()).abs()
    assert (error <= runs.double().abs() / 16 + scales.double()[..., None] * 2**-10).all()  # a half-ulp of e4m3


def test_dynamic_products_are_w8a8_arithmetic():
    """Over 64 rows: FP8 segments multiply the dequantized e4m3 activations in float32, the float segment the
    activations as they are; up to 64 rows: `quantized_linear` exactly."""
    weight = fp8_weight([48, 40], 256, float_rows=8)
    x = torch.randn(65, 256, generator=torch.Generator().manual_seed(2))
    got = reference.fp8_dynamic_linear(x, weight)
    activations = reference.dequantize_activations(*reference.quantize_activations(x), torch.float64)
    segments = [dequantize(data, qtype).double() for qtype, data in weight.segments]
    want_fp8 = activations @ torch.cat(segments[:2]).T
    torch.testing.assert_close(got[:, :88].double(), want_fp8, rtol=1e-5, atol=1e-4)  # float32 sums
    assert torch.equal(got[:, 88:], F.linear(x, segments[2].float()))
    assert (got[:, :88] - quantized_linear(x, weight)[:, :88]).abs().max() > 1e-3  # the activations were quantized
    assert torch.equal(reference.fp8_dynamic_linear(x[:64], weight), quantized_linear(x[:64], weight))
    floats = fp8_weight([], 256, float_rows=8)
    assert torch.equal(reference.fp8_dynamic_linear(x, floats), quantized_linear(x, floats))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-activations")
    return write_fp8_checkpoint(write_checkpoint(root / "source", "qwen3_5", seed=3, **FP8_DIMS), root / "fp8")


def run(path, params: SamplingParams, prompts=(LONG_PROMPT, [5, 6, 7]), **options):
    llm = LLM(str(path), **(OPTIONS | options))
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.close()


def prompt_logprobs(path, prompt: list[int], **options) -> list[float]:
    """The logprob of each prompt token after the first, one prefill pass of the prompt alone."""
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = run(path, scored, [prompt], **options)
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]


def test_the_engine_quantizes_prefill_activations_and_speculation_stays_exact(fp8_checkpoint):
    plain = prompt_logprobs(fp8_checkpoint, LONG_PROMPT)
    dynamic = prompt_logprobs(fp8_checkpoint, LONG_PROMPT, fp8_activations="dynamic")
    assert max(abs(a - b) for a, b in zip(plain, dynamic)) > 1e-6  # the 136-row pass ran W8A8
    short = LONG_PROMPT[:40]
    assert prompt_logprobs(fp8_checkpoint, short) == prompt_logprobs(fp8_checkpoint, short, fp8_activations="dynamic")
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = run(fp8_checkpoint, greedy, fp8_activations="dynamic")
    got = run(fp8_checkpoint, greedy, fp8_activations="dynamic", speculative="ngram", draft_tokens=4)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_an_unknown_activation_setting_is_refused_in_a_sentence(fp8_checkpoint):
    with pytest.raises(DeltaspecError, match="Unknown --fp8-activations 'e5m2'; use none or dynamic"):
        LLM(str(fp8_checkpoint), **(OPTIONS | {"fp8_activations": "e5m2"}))


kernels = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])


@pytest.fixture
def triton_w8a8():
    from deltaspec.ops.triton import w8a8

    return w8a8


@pytest.mark.gpu
@pytest.mark.kernel
@kernels
@pytest.mark.parametrize("shape", [(7, 1280), (3, 384)])
def test_the_quantization_kernel_writes_the_reference_bytes(triton_w8a8, kernel_device, dtype, shape):
    x = wide_range_activations(*shape, dtype, kernel_device)
    values, scales = triton_w8a8.quantize_activations(x)
    want_values, want_scales = reference.quantize_activations(x)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales) and scales.stride() == (1, shape[0])  # token-fastest, as cuBLAS reads
    values, scales = triton_w8a8.quantize_activations(x, rows_multiple=4)  # rows padded as cuBLAS needs
    assert values.shape == (-(-shape[0] // 4) * 4, shape[1]) and torch.equal(
        values[: shape[0]].float(), want_values.float()
    )
    assert (values[shape[0] :].float() == 0).all() and (scales[shape[0] :] == 1).all()


@pytest.mark.gpu
@pytest.mark.kernel
def test_the_split_kernel_separates_values_and_scales(triton_w8a8, kernel_device):
    blocks = fp8_weight([37], 1280).segments[0][1].to(kernel_device)
    values, scales = triton_w8a8.split_blocks(blocks)
    stored = blocks.view(37, 10, 132)
    assert torch.equal(values.view(torch.uint8), stored[..., 4:].reshape(37, 1280))
    assert torch.equal(scales, stored[..., :4].contiguous().view(torch.float32).view(37, 10))
    assert scales.stride() == (1, 37)  # row-fastest, as cuBLAS reads


@pytest.mark.gpu
@pytest.mark.skipif(triton_interpreted(), reason="cuBLAS's FP8 product needs a GPU")
@pytest.mark.parametrize("rows", [65, 100, 1000])
def test_cublas_block_scaled_products_follow_the_reference(triton_w8a8, rows):
    """FP8 segments of widths cuBLAS takes (256) and does not (40, the reference's arithmetic) and a float segment,
    bf16 activations: within the output's rounding of the reference (float32 sums in another order)."""
    if not triton_w8a8.tensor_cores(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("cuBLAS's block-scaled FP8 product needs a Hopper GPU and torch with scaled_mm")
    weight = fp8_weight([256, 40], 512, float_rows=24).cuda()
    x = torch.randn(rows, 512, device="cuda").bfloat16()
    got = triton_w8a8.fp8_dynamic_linear(x, weight)
    want = reference.fp8_dynamic_linear(x, weight)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    assert (got == want).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(triton_interpreted(), reason="the engine's CUDA path needs a GPU")
def test_the_cuda_engine_follows_the_reference_with_dynamic_activations(fp8_checkpoint, monkeypatch):
    """bf16 on CUDA: the prompt logprobs of a 200-token prompt (a 136-row W8A8 pass) with the CUDA path (Triton
    quantization, cuBLAS FP8) and with the reference's W8A8 product in its place, every other kernel the same,
    agree within bf16 rounding. (The whole reference stack against the kernels in bf16 is no oracle: on this
    tiny random model their greedy tokens part at a near-tie.)"""
    from deltaspec.ops import dispatch

    cuda = dict(device="cuda", dtype="bfloat16", fp8_activations="dynamic")
    got = prompt_logprobs(fp8_checkpoint, LONG_PROMPT, **cuda)
    monkeypatch.setitem(dispatch._BACKENDS["cuda"], "fp8_dynamic_linear", reference.fp8_dynamic_linear)
    want = prompt_logprobs(fp8_checkpoint, LONG_PROMPT, **cuda)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.05
