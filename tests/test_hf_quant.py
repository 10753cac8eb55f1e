"""Hugging Face FP8 block-scaled checkpoints (tiny models in the layout of Qwen's `-FP8` releases, float8 e4m3
values with float32 `weight_scale_inv` tiles): kept as FP8_B128 blocks that dequantize bit for bit as
transformers does; the logits of the dequantized checkpoint within 1e-9 in float64, dense and MoE, one process
or tensor / expert parallel; greedy speculative decoding exact; the plan counts the blocks; other quantization
methods refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaspec import LLM, SamplingParams
from deltaspec.errors import DeltaspecError
from deltaspec.model.hf_quant import Blocks  # noqa: F401 - the module under test
from deltaspec.ops.quant import dequantize
from deltaspec.ops.quant.fp8 import quantize_tiles, tiles_to_blocks
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.tiny_models import (
    FP8_DIMS,
    FP8_MOE_DIMS,
    dequantize_fp8_tiles,
    write_checkpoint,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
)

OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=4, max_model_len=512)
PROMPTS = [[1, 5, 9, 200, 33, 7], list(range(40, 75)), [7, 8, 9, 10] * 6]
LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=4, prompt_logprobs=3)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{kind: (FP8 checkpoint, its dequantized float32 copy)}."""
    root = tmp_path_factory.mktemp("fp8")
    made = {}
    for kind, dims in (("qwen3_5", FP8_DIMS), ("qwen3_5_moe", FP8_MOE_DIMS), ("qwen3_next", FP8_MOE_DIMS)):
        source = write_checkpoint(root / kind, kind, seed=3, **dims)
        quantized = write_fp8_checkpoint(source, root / f"{kind}-fp8")
        made[kind] = quantized, write_dequantized_checkpoint(quantized, root / f"{kind}-dequantized")
    return made


def test_blocks_dequantize_bit_for_bit_as_transformers_does():
    weight = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    values, scale_inv = quantize_tiles(weight)
    assert values.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    want = dequantize_fp8_tiles(values, scale_inv, [128, 128])
    fp8_module = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if hasattr(fp8_module, "_dequantize_fp8_weight"):  # transformers 5.2x's own definition
        assert torch.equal(fp8_module._dequantize_fp8_weight(values, scale_inv, [128, 128], torch.float32), want)
    assert torch.equal(dequantize(tiles_to_blocks(values, scale_inv), "FP8_B128"), want)
    rows = tiles_to_blocks(values[130:200], scale_inv, first_row=130)  # a tensor-parallel rank's rows
    assert torch.equal(dequantize(rows, "FP8_B128"), want[130:200])
    assert (want - weight).abs().max() <= weight.abs().max() / 16  # e4m3 keeps 3 mantissa bits


def generate(path: Path, params: SamplingParams = LOGPROBS, **options):
    llm = LLM(str(path), **(OPTIONS | options))
    try:
        return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    finally:
        llm.close()


def assert_same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, theirs in zip(
            [*a.outputs[0].logprobs, *a.prompt_logprobs[1:]], [*b.outputs[0].logprobs, *b.prompt_logprobs[1:]]
        ):
            assert mine.keys() == theirs.keys()
            for token in mine:
                assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-9)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_fp8_checkpoints_give_the_logits_of_their_dequantized_weights(fp8, kind):
    quantized, dequantized = fp8[kind]
    llm, got = generate(quantized)
    layer = llm.engine.model.model.layers[0]
    mlp = layer.mlp.experts.gate_up_proj if kind != "qwen3_5" else layer.mlp.gate_up_proj.weight
    assert isinstance(mlp, QuantizedWeight) and mlp.qtypes == ("FP8_B128",)
    assert_same(got, generate(dequantized)[1])


def test_fp8_under_tensor_and_expert_parallelism(fp8):
    """Each rank reads its rows, or its whole 128-value blocks of input columns, of every FP8 matrix (and with
    expert parallelism its whole experts): the logits of one process."""
    quantized, _ = fp8["qwen3_5_moe"]
    want = generate(quantized)[1]
    assert_same(generate(quantized, tensor_parallel_size=2)[1], want)
    assert_same(generate(quantized, tensor_parallel_size=2, enable_expert_parallel=True)[1], want)


def test_greedy_speculation_on_fp8_weights_is_exact(fp8):
    quantized, _ = fp8["qwen3_next"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = generate(quantized, greedy)[1]
    spec = generate(quantized, greedy, speculative="ngram", draft_tokens=4)[1]
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_the_plan_counts_fp8_blocks(fp8):
    """The plan's weight bytes (from the safetensors headers) are what a bf16 engine holds: the e4m3 values with a
    float32 scale per 128 of them, the float tensors in bf16."""
    from deltaspec.cache.memory_plan import weight_bytes
    from deltaspec.model.weights import checkpoint_files

    quantized, dequantized = fp8["qwen3_5"]
    planned = weight_bytes(checkpoint_files(quantized), torch.bfloat16, lambda name: False)
    llm = LLM(str(quantized), **(OPTIONS | dict(dtype="bfloat16")))
    try:
        model = llm.engine.model
        floats = sum(p.numel() * p.element_size() for p in model.parameters())
        held = floats + sum(m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))
    finally:
        llm.close()
    assert planned == held
    assert planned < 0.6 * weight_bytes(checkpoint_files(dequantized), torch.bfloat16, lambda name: False)


@pytest.mark.parametrize(
    ("quantization", "says"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq', which deltaspec does not load"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
        ({"quant_method": "fp8"}, "weight_block_size None (per-tensor scales when absent)"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
    ],
)
def test_other_quantizations_are_refused_in_one_sentence(fp8, tmp_path, quantization, says):
    quantized, _ = fp8["qwen3_5"]
    path = tmp_path / "other"
    path.mkdir()
    for file in quantized.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    with pytest.raises(DeltaspecError, match="loads FP8 block-scaled checkpoints") as refusal:
        LLM(str(path), **OPTIONS)
    assert says in str(refusal.value)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_fp8_checkpoints_on_the_gpu_follow_their_dequantized_weights(fp8, kind):
    """On CUDA in bf16 with CUDA graphs: the FP8 blocks through the block kernels (the GEMV, the tensor-core tiles,
    the expert kernels) give the greedy tokens of the dequantized checkpoint's bf16 model, and logprobs within bf16
    rounding."""
    quantized, dequantized = fp8[kind]
    cuda = dict(device="cuda", dtype="bfloat16")
    got, want = generate(quantized, **cuda)[1], generate(dequantized, **cuda)[1]
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            token = next(iter(theirs))
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=0.1)
