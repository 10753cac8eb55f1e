"""`deltaspec quantize --random-weights --shape NAME` (`deltaspec.model.gguf_write_random`): a shape's random
weights as a GGUF file with llama-quantize's names, order, shapes and types (tests/data/gguf_write's oracles) and
the converter's hyperparameters, a tokenizer llama.cpp and deltaspec load, and the weights the in-process
random model draws with the same seed; written one tensor at a time."""

from __future__ import annotations

import gzip
import json
import weakref
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch

from deltaspec.cli import main
from deltaspec.llm import LLM
from deltaspec.model import gguf_write_random
from deltaspec.model.gguf_write_random import RANDOM_KEY, write_random_gguf
from deltaspec.model.hf_config import parse_model_config, read_config_json
from deltaspec.model.shapes import shape_config
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.engine_helpers import forward_in_chunks
from tools.make_gguf_fixtures import write_hf_checkpoint

DATA = Path(__file__).parents[1] / "data"
ORACLES = json.loads(gzip.decompress((DATA / "gguf_write" / "oracles.json.gz").read_bytes()))["cases"]
SMALL = (("num_hidden_layers", 4), ("hidden_size", 256), ("intermediate_size", 512), ("vocab_size", 512))
MOE = (("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 256))
SHAPES = {  # shape -> overrides for a 2-core CI machine: the real heads, fewer and narrower layers
    "qwen3.5-27b": SMALL,
    "qwen3.5-35b-a3b": SMALL + MOE + (("shared_expert_intermediate_size", 256),),
    "qwen3-next-80b-a3b": SMALL + MOE + (("shared_expert_intermediate_size", 256),),
}
# value heads of 256: Qwen3.5's ssm_out columns move between heads in whole Q4_K / Q6_K blocks
WHOLE_BLOCK_HEADS = (("linear_value_head_dim", 256),)
PROMPT = [1, 7, 300, 42, 5, 260, 99, 3]
OPTIONS = dict(dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
ARCH_KEYS = ("block_count", "context_length", "embedding_length", "attention.", "ssm.", "expert", "rope.", "feed")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixture_config(tmp_path: Path, case: str):
    """The ModelConfig of an oracle case's checkpoint, with the MTP layers its file has."""
    raw = read_config_json(write_hf_checkpoint(tmp_path / case, case))
    arch = ORACLES[case]["metadata"]["general.architecture"]
    return replace(
        parse_model_config(raw), num_mtp_layers=ORACLES[case]["metadata"].get(f"{arch}.nextn_predict_layers", 0)
    )


@pytest.mark.parametrize("case", ["qwen35", "qwen35moe", "qwen3next"])
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_tensors_and_hyperparameters_are_llama_quantizes(case, kind, tmp_path):
    """Names, order, stored shapes and types of every tensor as llama-quantize wrote them for a checkpoint of the
    same config (a tied one, one with the MTP head, Qwen3-Next's ssm_ba), and its hyperparameter keys."""
    path = tmp_path / "random.gguf"
    write_random_gguf(fixture_config(tmp_path, case), case, path, kind, progress=False)
    reader = gguf.GGUFReader(path)
    mine = {t.name: f"{t.tensor_type.name}:{'x'.join(map(str, t.shape.tolist()))}" for t in reader.tensors}
    want = {n: d.rsplit(":", 1)[0] for n, d in ORACLES[case][kind].items() if n not in ("file", "general.file_type")}
    assert list(mine) == list(want) and mine == want
    assert int(reader.fields["general.file_type"].contents()) == ORACLES[case][kind]["general.file_type"]
    arch = ORACLES[case]["metadata"]["general.architecture"]
    hyper = {k: v for k, v in ORACLES[case]["metadata"].items() if k.startswith(arch) and "rope.freq_base" not in k}
    assert {k: reader.fields[k].contents() for k in hyper} == hyper
    assert reader.fields[RANDOM_KEY].contents() is True and reader.fields[f"{RANDOM_KEY}.seed"].contents() == 0


def in_process(shape: str, overrides: tuple, kind: str) -> LLM:
    return LLM(random_weights=True, shape=shape, shape_overrides=overrides, quant=kind, **OPTIONS)


@pytest.mark.parametrize(
    ("shape", "extra", "kind"),
    [
        ("qwen3.5-27b", (), "Q8_0"),
        ("qwen3.5-27b", WHOLE_BLOCK_HEADS, "Q4_K_M"),
        ("qwen3.5-35b-a3b", WHOLE_BLOCK_HEADS, "Q4_K_M"),
        ("qwen3.5-35b-a3b", (), "Q8_0"),
        ("qwen3-next-80b-a3b", (), "Q4_K_M"),
        ("qwen3-next-80b-a3b", (), "Q8_0"),
    ],
)
def test_the_file_holds_the_in_process_random_model(shape, extra, kind, tmp_path):
    """deltaspec loads the file as the model `--random-weights --shape S --quant T` draws with the same seed: the
    same logits (the norms and A_log travel as w + 1 and -exp(A_log) in float32)."""
    overrides = SHAPES[shape] + extra
    path = tmp_path / "random.gguf"
    write_random_gguf(shape_config(shape, overrides), shape, path, kind, progress=False)
    from_file = forward_in_chunks(LLM(str(path), **OPTIONS).engine, PROMPT, [len(PROMPT)])
    drawn = forward_in_chunks(in_process(shape, overrides, kind).engine, PROMPT, [len(PROMPT)])
    assert torch.isfinite(from_file).all() and from_file.std() > 0.5
    torch.testing.assert_close(from_file, drawn, rtol=0, atol=2e-5)


def test_out_proj_blocks_that_straddle_value_heads_are_kept_as_drawn(tmp_path):
    """Q4_K blocks of 256 columns over value heads of 128 cannot be tiled: the file keeps the drawn bytes (which
    deltaspec reads with an input order, as any such file), so every quantized weight equals the drawn one."""
    path = tmp_path / "random.gguf"
    write_random_gguf(shape_config("qwen3.5-27b", SMALL), "qwen3.5-27b", path, "Q4_K_M", progress=False)
    loaded = LLM(str(path), **OPTIONS).engine.model
    drawn = in_process("qwen3.5-27b", SMALL, "Q4_K_M").engine.model
    weights = {name: m for name, m in drawn.named_modules() if isinstance(m, QuantizedWeight)}
    read = {name: m for name, m in loaded.named_modules() if isinstance(m, QuantizedWeight)}
    assert weights.keys() == read.keys()
    for name, weight in weights.items():
        assert [(q, d.tolist()) for q, d in weight.segments] == [(q, d.tolist()) for q, d in read[name].segments]
    assert read["model.layers.0.linear_attn.out_proj.weight"].input_order is not None
    assert torch.isfinite(forward_in_chunks(LLM(str(path), **OPTIONS).engine, PROMPT, [len(PROMPT)])).all()


def test_the_tokenizer_has_the_shapes_vocabulary_and_reads_any_text(tmp_path):
    """A tied shape's embeddings get the LM head's Q6_K; the minimal tokenizer spans the vocabulary, splits any
    text into byte tokens and back, and ends on <|im_end|>."""
    path = tmp_path / "random.gguf"
    write_random_gguf(shape_config("qwen3.5-0.8b", SMALL), "qwen3.5-0.8b", path, "Q4_K_M", progress=False)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and tensors["token_embd.weight"].tensor_type.name == "Q6_K"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 512
    tokenizer = LLM(str(path), **OPTIONS).tokenizer
    text = "Hello,  wörld!\n\tdef f(): return 1"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and max(ids) < 260
    assert tokenizer.id_to_token(next(iter(tokenizer.eos_token_ids))) == "<|im_end|>"


def test_parameters_are_written_one_at_a_time(monkeypatch, tmp_path):
    """When a parameter is drawn, at most two earlier ones are alive: the one being written and a Qwen3-Next
    layer's in_proj_b, which waits for its in_proj_a; so a file far larger than memory can be written."""
    drawn = gguf_write_random.random_parameters
    alive: list[weakref.ref] = []
    most = 0

    def watched(*args, **kwargs):
        nonlocal most
        for name, value in drawn(*args, **kwargs):
            most = max(most, sum(ref() is not None for ref in alive))
            alive.append(weakref.ref(value))
            yield name, value
            del value

    monkeypatch.setattr(gguf_write_random, "random_parameters", watched)
    shape = "qwen3-next-80b-a3b"
    write_random_gguf(shape_config(shape, SHAPES[shape]), shape, tmp_path / "random.gguf", "Q4_K_M", progress=False)
    assert len(alive) > 50 and most <= 2


def test_cli_writes_a_random_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("deltaspec.quantize.command.shape_config", lambda name: shape_config(name, SMALL))
    out = tmp_path / "random.gguf"
    main(["quantize", "--random-weights", "--shape", "qwen3.5-27b", "--type", "q8_0", "--seed", "3", str(out)])
    printed = capsys.readouterr().out
    assert "random weights: shape qwen3.5-27b, seed 3" in printed and "(q8_0)" in printed
    reader = gguf.GGUFReader(out)
    assert reader.fields[f"{RANDOM_KEY}.shape"].contents() == "qwen3.5-27b"
    assert reader.fields[f"{RANDOM_KEY}.seed"].contents() == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "qwen3.5-27b"], "--shape names the shape of --random-weights"),
        (["--random-weights"], "--random-weights needs --shape NAME"),
        (["--random-weights", "--shape", "qwen9"], "Unknown shape 'qwen9'"),
        (["--random-weights", "--shape", "qwen3.5-27b", "--calibration", "x.txt"], "leave out MODEL and --calibration"),
    ],
)
def test_user_errors_are_one_sentence(args, message, capsys, tmp_path):
    assert main(["quantize", *args, "--type", "q4_k_m", str(tmp_path / "x.gguf")]) != 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
