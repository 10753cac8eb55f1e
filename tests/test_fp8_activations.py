"""FP8 activations for the prefill products of FP8 weights (`--fp8-activations`, W8A8). The reference: each row's
groups of 128 columns rounded to the nearest e4m3 value after dividing by amax / 448, and the product the sum of
(activation scale x block scale x e4m3 products), checked against both definitions written out independently.
The engine: with the option, products of more than 64 rows (a long prompt's chunk) change and products of fewer
(short prompts, decode, verify) stay exact; greedy speculation stays exact. On CUDA: the quantize kernel bit for
bit and the FP8 tensor-core product within float32 accumulation of the reference, partial tiles and several
segments; an FP8 checkpoint's prompt logprobs through the kernels follow the reference engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaspec import LLM, SamplingParams
from deltaspec.errors import DeltaspecError
from deltaspec.ops.dispatch import ops_for
from deltaspec.ops.quant.fp8_activations import (
    fp8_activation_linear,
    quantize_activations,
    takes_fp8_activations,
)
from deltaspec.ops.quant.quantize import quantize
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.tiny_models import FP8_DIMS, write_checkpoint, write_fp8_checkpoint

E4M3_VALUES = (
    torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    .view(torch.float8_e4m3fn)
    .to(torch.float64)
)  # every finite e4m3 value


def activations(rows: int, columns: int, seed: int) -> torch.Tensor:
    """Normal activations whose groups of 128 columns span magnitudes 2**-10 .. 2**6, one group all zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=gen, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-10, 7, (rows, columns // 128, 1), generator=gen).repeat_interleave(128, 1).view(x.shape)
    x[0, :128] = 0
    return x


def test_activations_round_to_the_nearest_e4m3_value_of_their_scaled_group():
    x = activations(5, 384, seed=1)
    values, scales = quantize_activations(x)
    groups = x.view(5, 3, 128).to(torch.float32)  # scales and quotients in float32, as the kernel computes them
    amax = groups.abs().amax(-1)
    assert torch.equal(scales, torch.where(amax > 0, amax / 448, 1.0))
    scaled = (groups / scales[..., None]).to(torch.float64)
    nearest = E4M3_VALUES[(scaled[..., None] - E4M3_VALUES).abs().argmin(-1)]
    assert torch.equal(values.view(5, 3, 128).to(torch.float64), nearest)
    assert values.view(5, 3, 128).to(torch.float64).abs().amax(-1)[amax > 0].eq(448).all()


def test_fp8_activation_products_are_scaled_sums_of_e4m3_products():
    x = activations(70, 256, seed=2)
    weight = QuantizedWeight([("FP8_B128", quantize(torch.randn(3, 256, dtype=torch.float64), "FP8_B128"))], 256)
    values, scales = quantize_activations(x)
    w_values = weight.segment0.view(3, 2, 132)[..., 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    w_scales = weight.segment0.view(3, 2, 132)[..., :4].contiguous().view(torch.float32).view(3, 2).to(torch.float64)
    w = (w_values * w_scales[..., None]).to(torch.float32).to(torch.float64)  # weights dequantize in float32
    a = values.to(torch.float64).view(70, 2, 128) * scales.to(torch.float64)[..., None]
    want = torch.einsum("mgk,ngk->mn", a, w)
    got = fp8_activation_linear(x, weight)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert takes_fp8_activations(weight, 65) and not takes_fp8_activations(weight, 64)
    assert not takes_fp8_activations(QuantizedWeight.from_float(torch.randn(3, 256)), 65)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8-activations")
    return write_fp8_checkpoint(write_checkpoint(root / "bf", "qwen3_5", seed=3, **FP8_DIMS), root / "fp8")


LONG = [(7 * i) % 180 + 3 for i in range(200)]  # 200 prompt rows: a chunk of 136, then 64 (its checkpoint)
SHORT = [1, 5, 9, 200, 33, 7]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def run(path: Path, prompt: list[int], params: SamplingParams = PARAMS, **options):
    llm = LLM(str(path), dtype="float64", device="cpu", max_num_seqs=2, max_model_len=256, **options)
    try:
        return llm.generate([{"prompt_token_ids": prompt}], params)[0]
    finally:
        llm.close()


def logprobs(output) -> list[float]:
    rows = [*output.prompt_logprobs[1:], *output.outputs[0].logprobs]
    return [entry[token].logprob for entry in rows for token in sorted(entry)]


def prompt_logprobs(output, prompt: list[int]) -> torch.Tensor:
    """The logprob of each prompt token after the first."""
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])


def test_only_products_of_more_than_64_rows_quantize_their_activations(fp8_model):
    exact, w8a8 = run(fp8_model, LONG), run(fp8_model, LONG, fp8_activations=True)
    difference = (prompt_logprobs(exact, LONG) - prompt_logprobs(w8a8, LONG)).abs()
    assert 1e-4 < difference.mean() < 0.03 and difference.max() < 0.15  # measured: 0.006 and 0.028
    assert logprobs(run(fp8_model, SHORT, fp8_activations=True)) == logprobs(run(fp8_model, SHORT))
    chunked = run(fp8_model, LONG, fp8_activations=True, prefill_chunk=50)  # chunks of 50 rows: all exact
    assert logprobs(chunked) == pytest.approx(logprobs(exact), abs=1e-9)


def test_greedy_speculation_with_fp8_activations_is_exact(fp8_model):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = run(fp8_model, LONG, greedy, fp8_activations=True).outputs[0].token_ids
    spec = run(fp8_model, LONG, greedy, fp8_activations=True, speculative="ngram", draft_tokens=4)
    assert spec.outputs[0].token_ids == plain


@pytest.mark.gpu  # not under Triton's interpreter: it converts float32 to e4m3 wrongly (test_kernels_attention)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantize_kernel_is_the_reference_bit_for_bit(dtype):
    from deltaspec.ops.triton import fp8_matmul

    x = activations(33, 1280, seed=4).to(dtype)
    got_values, got_scales = fp8_matmul.quantize_activations(x.cuda())
    want_values, want_scales = quantize_activations(x)
    assert torch.equal(got_values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(got_scales.cpu(), want_scales)


@pytest.mark.gpu  # not under Triton's interpreter: it converts float32 to e4m3 wrongly (test_kernels_attention)
@pytest.mark.parametrize(("rows", "parts", "columns"), [(65, (128,), 128), (300, (200, 56), 512), (1030, (384,), 1280)])
def test_the_fp8_tensor_core_product_follows_the_reference(rows, parts, columns):
    """Partial row and column tiles, two segments; the float32 sums of e4m3 products match the reference's
    float64 ones to float32 rounding (the tensor cores add each 128-column step in float32)."""
    from deltaspec.ops.triton import fp8_matmul

    gen = torch.Generator().manual_seed(rows)
    segments = [("FP8_B128", quantize(torch.randn(n, columns, generator=gen), "FP8_B128")) for n in parts]
    weight = QuantizedWeight(segments, columns).cuda()
    x = activations(rows, columns, seed=rows).to(torch.bfloat16)
    want = fp8_activation_linear(x.to(torch.float64), weight.cpu())
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_matmul.fp8_activation_linear(x.to(dtype).cuda(), weight).cpu().to(torch.float64)
        scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        assert ((got - want).abs() / scale).max() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
def test_fp8_checkpoints_prefill_through_the_kernels_as_the_reference(fp8_model):
    """In float32 on CUDA with CUDA graphs: the long prompt's logprobs through the FP8 tensor-core product match
    the reference engine's (the same W8A8 products, float32 sums) within 1e-3."""
    cuda = dict(device="cuda", dtype="float32", fp8_activations=True)
    llm = LLM(str(fp8_model), max_num_seqs=2, max_model_len=256, **cuda)
    try:
        got = llm.generate([{"prompt_token_ids": LONG}], PARAMS)[0]
    finally:
        llm.close()
    llm = LLM(str(fp8_model), max_num_seqs=2, max_model_len=256, kernels="reference", **cuda)
    try:
        want = llm.generate([{"prompt_token_ids": LONG}], PARAMS)[0]
    finally:
        llm.close()
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-3)


def test_fp8_activations_need_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(DeltaspecError, match="compute capability 8.9 or more.*A100 lacks"):
        ops_for("cuda:0", fp8_activations=True)
