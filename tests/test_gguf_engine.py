"""GGUF files in the engine: the llama.cpp-converted fixtures (tests/data/gguf, made by tools/make_gguf_fixtures.py)
load with their weights kept quantized, give the logits of the same model with every weight dequantized to
float64 (1e-9), generate from text through the file's own tokenizer, speculate token-exactly, and work
through the CLI; the memory plan counts the quantized bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaspec import LLM, SamplingParams
from deltaspec.config import EngineConfig
from deltaspec.engine.planning import plan_for
from deltaspec.model.layers import QuantizedEmbedding, set_weight
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.engine_helpers import forward_in_chunks

DATA = Path(__file__).parent / "data" / "gguf"
QUANTIZED = ["qwen35-q8_0", "qwen35moe-q8_0", "qwen3next-q8_0", "qwen3next-q8_0-split-00001-of-00004"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [3, 17, 42, 5, 99, 12, 7, 64, 23, 11]


def fixture(name: str) -> str:
    return str(DATA / f"{name}.gguf")


def llm_of(name: str, **options) -> LLM:
    return LLM(fixture(name), dtype="float64", device="cpu", max_num_seqs=2, max_model_len=128, **options)


def true_matrix(weight: QuantizedWeight) -> torch.Tensor:
    """The float64 matrix a QuantizedWeight stands for, its columns back in the input's order."""
    stored = weight.dequantize(torch.float64)
    if weight.input_order is None:
        return stored
    matrix = torch.empty_like(stored)
    matrix[..., weight.input_order] = stored
    return matrix


def dequantize_model(model: torch.nn.Module) -> None:
    """Replace every weight kept as GGUF blocks by its float64 values (the reference the blocks must match)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantizedEmbedding):
                embedding = torch.nn.Embedding(*child.weight.shape, _weight=true_matrix(child.weight))
                setattr(module, name, embedding)
            elif isinstance(child, QuantizedWeight):
                set_weight(module, name, true_matrix(child))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_logits_equal_the_dequantized_model(name):
    llm = llm_of(name)
    engine = llm.engine
    kept = [m for m in engine.model.modules() if isinstance(m, QuantizedWeight)]
    assert kept and all(w.nbytes > 0 for w in kept)
    quantized = forward_in_chunks(engine, PROMPT, [len(PROMPT)])
    dequantize_model(engine.model)
    assert not any(isinstance(m, QuantizedWeight) for m in engine.model.modules())
    reference = forward_in_chunks(engine, PROMPT, [len(PROMPT)])
    torch.testing.assert_close(quantized, reference, rtol=0, atol=1e-9)


def test_f32_file_gives_the_hf_checkpoints_logits(tmp_path):
    """The f32 fixture is the HF checkpoint it was converted from: same logits as loading that checkpoint."""
    from tools.make_gguf_fixtures import write_hf_checkpoint

    hf_dir = write_hf_checkpoint(tmp_path / "qwen35", "qwen35")
    from_file = forward_in_chunks(llm_of("qwen35-f32").engine, PROMPT, [len(PROMPT)])
    from_hf = LLM(str(hf_dir), dtype="float64", device="cpu", max_num_seqs=2, max_model_len=128).engine
    torch.testing.assert_close(from_file, forward_in_chunks(from_hf, PROMPT, [len(PROMPT)]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen35-bf16", "qwen35-f16"])
def test_float_files_load_as_float_parameters(name):
    """16-bit files become ordinary parameters in the engine's dtype, close to the f32 file's model."""
    engine = llm_of(name).engine
    assert not any(isinstance(m, QuantizedWeight) for m in engine.model.modules())
    logits = forward_in_chunks(engine, PROMPT, [len(PROMPT)])
    f32 = forward_in_chunks(llm_of("qwen35-f32").engine, PROMPT, [len(PROMPT)])
    torch.testing.assert_close(logits, f32, rtol=0, atol=0.05)


def test_text_generation_uses_the_files_tokenizer():
    llm = llm_of("qwen35-q8_0")
    assert llm.tokenizer is not None
    out = llm.generate(["def add(a, b):"], GREEDY)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


@pytest.mark.parametrize("speculative", ["ngram", "mtp", "mtp+ngram"])
def test_speculative_greedy_equals_plain_greedy_on_a_quantized_model(speculative):
    prompts = [{"prompt_token_ids": PROMPT * 2}, {"prompt_token_ids": [9, 8, 7, 9, 8, 7, 9, 8]}]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm_of("qwen35-q8_0").generate(prompts, params)]
    spec = llm_of("qwen35-q8_0", speculative=speculative, draft_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    if speculative != "ngram":
        assert spec.engine.model.mtp is not None


def test_plan_counts_the_quantized_bytes():
    """The plan's weights are what the engine holds: blocks for quantized tensors, the dtype for float ones."""
    planned = plan_for(EngineConfig(model=fixture("qwen35-q8_0"), dtype="float32", device="cpu", max_model_len=64))
    llm = LLM(fixture("qwen35-q8_0"), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    blocks = [b for m in llm.engine.model.modules() if isinstance(m, QuantizedWeight) for b in m.buffers()]
    held = {id(t): t.numel() * t.element_size() for t in (*llm.engine.model.parameters(), *blocks)}
    assert planned.plan.weights == sum(held.values())
    f32 = plan_for(EngineConfig(model=fixture("qwen35-f32"), dtype="float32", device="cpu", max_model_len=64))
    assert planned.plan.weights < 0.5 * f32.plan.weights


def test_cli_generates_from_a_gguf_file():
    run = subprocess.run(
        [sys.executable, "-m", "deltaspec.cli", "generate", "def f(", "--model", fixture("qwen35-q8_0")]
        + ["--device", "cpu", "--max-tokens", "5", "--max-model-len", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def f(") and "new tokens: 5" in run.stderr


def test_a_missing_gguf_file_is_one_sentence(tmp_path):
    from deltaspec import DeltaspecError

    with pytest.raises(DeltaspecError, match=r"^No GGUF file at .*missing\.gguf; give the path of an existing"):
        LLM(str(tmp_path / "missing.gguf"))


def test_bytes_per_step_count_the_blocks_and_one_embedding_row():
    """The decode roofline of a GGUF model is its format's: the blocks of every matrix, one embedding row."""
    from deltaspec.bench.roofline import bytes_per_step

    llm = LLM(fixture("qwen35-q8_0"), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    embedding = llm.engine.model.model.embed_tokens.weight
    assert isinstance(embedding, QuantizedWeight) and not llm.engine.model_config.tie_word_embeddings
    row = embedding.nbytes // embedding.shape[0]
    expected = llm.engine.plan.weights - embedding.nbytes + row  # the plan counts every weight once, no MTP
    assert bytes_per_step(llm.engine, context=10)["weights"] == expected
