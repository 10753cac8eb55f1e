"""`deltaspec kl`: KL(base || model) over a text's windows, top-1 agreement and both perplexities, with the base
run directly or read back from the logits file `--save-base` writes; user errors as one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import deltaspec
from deltaspec.cli import main
from deltaspec.evaluate import perplexity
from deltaspec.evaluate_kl import kl_divergence
from deltaspec.llm import LLM
from tests.engine_helpers import forward_in_chunks

MODELS = Path(deltaspec.__file__).resolve().parent / "default_model"
TARGET, DRAFT = str(MODELS / "target"), str(MODELS / "draft")
SAMPLE = str(Path(__file__).resolve().parents[1] / "data" / "heldout_code_sample.txt")
TEXT = Path(SAMPLE).read_text()
CPU = ["--device", "cpu", "--dtype", "float32"]
WINDOWS = ["--window", "64", "--max-windows", "2", SAMPLE]  # two windows of the sample text


def load(path: str, dtype: str = "float32", **options) -> LLM:
    return LLM(path, dtype=dtype, device="cpu", max_num_seqs=1, max_model_len=65, **options)


@pytest.fixture(scope="module")
def target() -> LLM:
    return load(TARGET)


@pytest.fixture(scope="module")
def draft() -> LLM:
    return load(DRAFT)


def run_kl(capsys, *args: str) -> dict:
    assert main(["kl", *args]) == 0
    return json.loads(capsys.readouterr().out)


def kl_error(capsys, *args: str) -> str:
    """The one `error: ...` line of a `deltaspec kl` that exits 2."""
    assert main(["kl", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith("."), err
    assert not any("Traceback" in line for line in err)
    return errors[0]


def test_a_model_against_itself_has_zero_kl(capsys):
    result = run_kl(capsys, "--base", TARGET, "--model", TARGET, "--device", "cpu", "--dtype", "float64", *WINDOWS)
    assert result["base"]["dtype"] == result["model"]["dtype"] == "float64"
    assert (result["windows"], result["positions"], result["window"], result["max_windows"]) == (2, 126, 64, 2)
    assert all(abs(v) < 1e-12 for v in result["kl"].values())
    assert result["top1_agreement"] == 1.0
    assert result["base"]["ppl"] == result["model"]["ppl"]


def test_target_against_draft_matches_torch(target, draft):
    result = kl_divergence(draft, TEXT, window=64, max_windows=1, base=target)
    window = target.tokenizer.encode(TEXT)[:64]
    lp_base, lp_draft = (
        torch.log_softmax(forward_in_chunks(llm.engine, window, [64])[:-1].float(), dim=-1)  # [63, V]
        for llm in (target, draft)
    )
    kl = torch.nn.functional.kl_div(lp_draft, lp_base, log_target=True, reduction="none").sum(-1).double()  # [63]
    targets = torch.tensor(window[1:])[:, None]  # [63, 1]
    assert result["positions"] == 63
    assert result["kl"]["mean"] > 0.05
    assert result["kl"]["mean"] == pytest.approx(kl.mean().item(), rel=1e-5)
    assert result["kl"]["median"] == pytest.approx(kl.median().item(), rel=1e-5)
    assert result["kl"]["p99"] == pytest.approx(kl.quantile(0.99).item(), rel=1e-5)
    assert result["kl"]["max"] == pytest.approx(kl.max().item(), rel=1e-5)
    agree = (lp_base.argmax(-1) == lp_draft.argmax(-1)).double().mean().item()
    assert result["top1_agreement"] == pytest.approx(agree)
    for name, lp in (("base", lp_base), ("model", lp_draft)):
        loss = -lp.gather(1, targets).double().mean().item()
        assert result[name]["loss"] == pytest.approx(loss, rel=1e-6)


def test_perplexities_match_deltaspec_ppl(target, draft):
    result = kl_divergence(draft, TEXT, window=64, max_windows=2, base=target)
    for name, llm in (("base", target), ("model", draft)):
        ppl = perplexity(llm, TEXT, window=64, max_windows=2)
        assert result[name]["ppl"] == pytest.approx(ppl["ppl"], rel=1e-6)
        assert result[name]["bits_per_byte"] == pytest.approx(ppl["bits_per_byte"], rel=1e-6)
        assert result["bytes"] == ppl["bytes"]


def test_windows_prefilled_in_chunks_give_the_same_kl(target, draft):
    whole = kl_divergence(draft, TEXT, window=64, max_windows=2, base=target)
    chunked = kl_divergence(load(DRAFT, prefill_chunk=24), TEXT, window=64, max_windows=2, base=target)
    for key in ("mean", "median", "p99", "max"):
        assert chunked["kl"][key] == pytest.approx(whole["kl"][key], rel=1e-4)
    assert chunked["top1_agreement"] == whole["top1_agreement"]


def test_bfloat16_against_float32_is_close(target):
    result = kl_divergence(load(TARGET, "bfloat16"), TEXT, window=64, max_windows=2, base=target)
    assert 0 < result["kl"]["mean"] < 0.01
    assert 0 < result["kl"]["max"] < 0.1
    assert result["top1_agreement"] > 0.9
    assert result["model"]["ppl"] == pytest.approx(result["base"]["ppl"], rel=0.01)


def test_saved_base_gives_the_same_numbers(capsys, tmp_path, target):
    saved = str(tmp_path / "base.safetensors")
    direct = run_kl(capsys, "--base", TARGET, "--model", DRAFT, "--save-base", saved, *CPU, *WINDOWS)
    assert direct["kl"]["mean"] > 0
    from_file = run_kl(capsys, "--base-logits", saved, "--model", DRAFT, *CPU, *WINDOWS)
    assert from_file == direct  # the identity of the base comes from the file, the numbers are exact
    only_base = run_kl(capsys, "--base", TARGET, "--save-base", str(tmp_path / "again.safetensors"), *CPU, *WINDOWS)
    assert only_base["base"]["ppl"] == direct["base"]["ppl"]
    assert "model" not in only_base and "kl" not in only_base
    tensors = load_file(saved)
    ids = target.tokenizer.encode(TEXT)[:128]
    assert tensors["token_ids"].tolist() == ids
    assert tensors["logits"].shape == (126, 8192) and tensors["logits"].dtype == torch.float32
    assert not list(tmp_path.glob("*.partial"))


def test_saved_base_for_other_tokens_is_refused(capsys, tmp_path):
    saved = str(tmp_path / "base.safetensors")
    run_kl(capsys, "--base", TARGET, "--save-base", saved, *CPU, *WINDOWS)
    error = kl_error(
        capsys, "--base-logits", saved, "--model", DRAFT, *CPU, "--window", "64", "--max-windows", "1", SAMPLE
    )
    assert "differ from those saved" in error
    other = tmp_path / "other.txt"
    other.write_text(TEXT[1000:])
    error = kl_error(capsys, "--base-logits", saved, "--model", DRAFT, *CPU, *WINDOWS[:4], str(other))
    assert "--window and --max-windows" in error


def test_other_vocabularies_are_refused(capsys, tmp_path, text_checkpoint, target):
    error = kl_error(capsys, "--base", TARGET, "--model", str(text_checkpoint), *CPU, *WINDOWS)
    assert "vocabulary of 8192 tokens" in error
    retokenized = shutil.copytree(DRAFT, tmp_path / "draft")
    tokenizer = json.loads((retokenized / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # token -> id
    names = {i: name for name, i in vocab.items()}
    first = target.tokenizer.encode(TEXT)[1]  # a token of the scored text gets its neighbour's id
    vocab[names[first]], vocab[names[first + 1]] = first + 1, first
    (retokenized / "tokenizer.json").write_text(json.dumps(tokenizer))
    error = kl_error(capsys, "--base", TARGET, "--model", str(retokenized), *CPU, *WINDOWS)
    assert "tokenizes the text differently" in error


def test_bad_requests_are_one_line_errors(capsys, tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    assert "no base logits file" in kl_error(capsys, "--base-logits", missing, "--model", DRAFT, SAMPLE)
    foreign = str(MODELS / "draft" / "model.safetensors")
    assert "not a base logits file" in kl_error(capsys, "--base-logits", foreign, "--model", DRAFT, SAMPLE)
    assert "--model" in kl_error(capsys, "--base", TARGET, SAMPLE)
    saving_a_file = ("--base-logits", foreign, "--save-base", missing, "--model", DRAFT, SAMPLE)
    assert "--save-base" in kl_error(capsys, *saving_a_file)
    assert "--window" in kl_error(capsys, "--base", TARGET, "--model", DRAFT, "--window", "1", SAMPLE)
    assert "Could not read" in kl_error(capsys, "--base", TARGET, "--model", DRAFT, str(tmp_path / "none.txt"))


@pytest.mark.parametrize(
    ("flags", "field", "bound"),
    [(["--state-dtype", "bfloat16"], "state_dtype", 1e-5), (["--kv-cache-dtype", "fp8_e4m3"], "kv_cache_dtype", 5e-3)],
)
def test_narrower_caches_are_measured_against_the_full_ones(capsys, flags, field, bound):
    """The base keeps its float32 state and KV (--base-state-dtype / --base-kv-cache-dtype auto) while the model
    narrows one, scored one token a pass as decoding runs; the bounds are 10x the mean KL measured on these 63
    positions (bf16 state 1.2e-6, fp8 KV 4.8e-4; int8 KV, 5.7e-5, takes the same path)."""
    one_window = ["--window", "64", "--max-windows", "1", SAMPLE]
    result = run_kl(capsys, "--base", TARGET, "--model", TARGET, *flags, "--prefill-chunk", "1", *CPU, *one_window)
    assert result["base"][field] == "float32" and result["model"][field] == flags[1]
    assert result["base"]["prefill_chunk"] == result["model"]["prefill_chunk"] == 1
    assert 0 < result["kl"]["mean"] < bound


def test_dynamic_fp8_activations_are_measured_against_the_fp8_weights_alone(capsys, tmp_path):
    """The base keeps bf16 activations (--base-fp8-activations none) while the model quantizes its prefill
    activations to e4m3 (a 63-row window is one pass of under 64 rows and stays exact, a 127-row one is W8A8); the
    bound is 10x the mean KL measured on these 127 positions (1.6e-4)."""
    from tests.tiny_models import FP8_DIMS, write_checkpoint, write_fp8_checkpoint

    source = write_checkpoint(tmp_path / "source", "qwen3_5", seed=3, tokenizer=True, **FP8_DIMS)
    fp8 = str(write_fp8_checkpoint(source, tmp_path / "fp8"))
    both = ("--base", fp8, "--model", fp8, "--fp8-activations", "dynamic", *CPU)
    result = run_kl(capsys, *both, "--window", "128", "--max-windows", "1", SAMPLE)
    assert result["base"]["fp8_activations"] == "none" and result["model"]["fp8_activations"] == "dynamic"
    assert 0 < result["kl"]["mean"] < 1.6e-3
    assert run_kl(capsys, *both, "--window", "64", "--max-windows", "1", SAMPLE)["kl"]["mean"] == 0
