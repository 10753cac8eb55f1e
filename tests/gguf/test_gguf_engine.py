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
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.planning import plan_for
from deltaspec.model.layers import QuantizedEmbedding, set_weight
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.engine_helpers import forward_in_chunks

DATA = Path(__file__).parents[1] / "data" / "gguf"
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


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "qwen3next"])
def test_f32_file_gives_the_hf_checkpoints_logits(tmp_path, family):
    """The f32 fixture is the HF checkpoint it was converted from: same logits as loading that checkpoint (for
    Qwen3-Next, whose file's GDN projections load as separate ones, against the grouped ones of its checkpoint)."""
    from tools.make_gguf_fixtures import write_hf_checkpoint

    hf_dir = write_hf_checkpoint(tmp_path / family, family)
    from_file = forward_in_chunks(llm_of(f"{family}-f32").engine, PROMPT, [len(PROMPT)])
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


@pytest.mark.parametrize("speculative", ["ngram", "mtp", "mtp+ngram", "draft", "draft+ngram"])
def test_speculative_greedy_equals_plain_greedy_on_a_quantized_model(speculative):
    """Every drafter; the draft model is a GGUF file too (the Qwen3.5-MoE q8_0 fixture, same tokenizer)."""
    prompts = [{"prompt_token_ids": PROMPT * 2}, {"prompt_token_ids": [9, 8, 7, 9, 8, 7, 9, 8]}]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm_of("qwen35-q8_0").generate(prompts, params)]
    draft = {"draft_model": fixture("qwen35moe-q8_0")} if speculative.startswith("draft") else {}
    spec = llm_of("qwen35-q8_0", speculative=speculative, draft_tokens=3, **draft)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    if speculative.startswith("mtp"):
        assert spec.engine.model.mtp is not None


def test_plan_counts_the_quantized_bytes():
    """The plan's weights are what the engine holds: blocks for quantized tensors, the dtype for float ones."""
    planned = plan_for(
        EngineConfig.from_flat(model=fixture("qwen35-q8_0"), dtype="float32", device="cpu", max_model_len=64)
    )
    llm = LLM(fixture("qwen35-q8_0"), dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    blocks = [b for m in llm.engine.model.modules() if isinstance(m, QuantizedWeight) for b in m.buffers()]
    held = {id(t): t.numel() * t.element_size() for t in (*llm.engine.model.parameters(), *blocks)}
    assert planned.plan.weights == sum(held.values())
    f32 = plan_for(EngineConfig.from_flat(model=fixture("qwen35-f32"), dtype="float32", device="cpu", max_model_len=64))
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


def test_qwen3_next_with_differently_quantized_qkv_and_gate(tmp_path):
    """llama-quantize's Q4_K_M gives a Qwen3-Next `attn_qkv` Q6_K where it gives `attn_v` more bits, and
    `attn_gate` Q4_K: they load as separate projections, each whole in its own type (the fused input projection
    is two segments, `ssm_ba`'s rows joining the Q4_K one), and the logits equal the dequantized model's."""
    import gguf

    from deltaspec.model.gguf_write import write_gguf
    from deltaspec.model.gguf_write_source import open_source
    from tests.tiny_models import write_checkpoint
    from tools.make_gguf_fixtures import give_qwen_pre_tokenizer

    layers = ["linear_attention"] * 3 + ["full_attention"]
    hf_dir = write_checkpoint(
        tmp_path / "hf", "qwen3_next", seed=0, tokenizer=True, vocab_size=400, hidden_size=256,
        intermediate_size=256, num_hidden_layers=8, layer_types=layers * 2, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, eos_token_id=379,
    )  # fmt: skip
    give_qwen_pre_tokenizer(hf_dir, "qwen2")
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(open_source(str(hf_dir)), path, "Q4_K_M", progress=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert (types["blk.0.attn_qkv.weight"], types["blk.0.attn_gate.weight"]) == ("Q6_K", "Q4_K")
    llm = LLM(str(path), dtype="float64", device="cpu", max_num_seqs=2, max_model_len=128)
    fused = llm.engine.model.model.layers[0].linear_attn.in_proj.weight  # in_proj_qkv | z | b | a
    assert fused.qtypes == ("Q6_K", "Q4_K")
    quantized = forward_in_chunks(llm.engine, PROMPT, [len(PROMPT)])
    dequantize_model(llm.engine.model)
    torch.testing.assert_close(quantized, forward_in_chunks(llm.engine, PROMPT, [len(PROMPT)]), rtol=0, atol=1e-9)


def test_a_gguf_draft_model_is_read_once_for_plan_and_load(tmp_path):
    """The planner and the drafter share one read of a GGUF draft model; a file that changed is read again."""
    import os
    import shutil

    from deltaspec.spec.draft_model import draft_checkpoint

    path = tmp_path / "draft.gguf"
    shutil.copy(fixture("qwen35moe-q8_0"), path)
    first = draft_checkpoint(path)[2]
    assert draft_checkpoint(path)[2] is first
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = draft_checkpoint(path)[2]
    assert again is not first and again.config == first.config
