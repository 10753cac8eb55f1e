"""The `deltaspec` command line, run in-process through `main()` (and once as `python -m deltaspec.cli`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltaspec import LLM, SamplingParams
from deltaspec.cli import main
from deltaspec.model.tokenizer import Tokenizer

PROMPT = "def add(a, b):"
REPO = Path(__file__).resolve().parent.parent


def generate_args(model, *extra) -> list[str]:
    return ["generate", "--model", str(model), "--prompt", PROMPT, "--dtype", "float32", "--device", "cpu", *extra]


def stats_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "prompt tokens:" in line]
    assert len(lines) == 1, err
    return lines[0]


def assert_one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert lines[0].endswith(".")
    assert "Traceback" not in err
    return lines[0]


def test_generate_greedy(text_checkpoint, capsys):
    assert main(generate_args(text_checkpoint, "--max-tokens", "8", "--ignore-eos")) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT)
    expected = (
        LLM(str(text_checkpoint), dtype="float32", device="cpu")
        .generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert out == PROMPT + expected + "\n"
    stats = stats_line(err)
    num_prompt = len(Tokenizer.from_dir(text_checkpoint).encode(PROMPT))
    assert f"prompt tokens: {num_prompt} " in stats
    assert "new tokens: 8 " in stats
    assert re.search(r"time to first token: \d+\.\d ms", stats), stats
    assert re.search(r"decode tok/s: \d+\.\d", stats), stats
    assert "finish: length" in stats
    assert "cpu float32" in stats
    assert "Loading weights" in err
    assert "Traceback" not in err


def test_sampling_with_seed_is_reproducible(text_checkpoint, capsys):
    def run(seed: int) -> str:
        args = generate_args(
            text_checkpoint, "--max-tokens", "8", "--ignore-eos", "--temperature", "0.8", "--seed-sample", str(seed)
        )
        assert main(args) == 0
        out, err = capsys.readouterr()
        assert "new tokens: 8 " in stats_line(err)
        return out

    first = run(3)
    assert first.startswith(PROMPT)
    assert run(3) == first
    assert run(4) != first  # the seed is really used (512-token vocab, 8 draws: a collision is ~impossible)


def test_bad_model_path(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["generate", "--model", str(missing), "--prompt", PROMPT, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    line = assert_one_error_line(err)
    assert str(missing) in line
    assert out == ""


def test_bad_dtype(text_checkpoint, capsys):
    args = ["generate", "--model", str(text_checkpoint), "--prompt", PROMPT, "--dtype", "int7", "--device", "cpu"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    line = assert_one_error_line(err)
    assert "'int7'" in line
    for name in ("float64", "float32", "bfloat16", "float16"):
        assert name in line
    assert out == ""


def test_no_model_uses_the_embedded_default(capsys):
    assert main(["generate", "--prompt", PROMPT, "--device", "cpu", "--max-tokens", "3", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and "new tokens: 3 " in stats_line(err)


def test_chat_and_ppl_commands(capsys, tmp_path):
    assert main(["chat", "--message", "Write a function that adds two numbers.", "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip()
    text = tmp_path / "code.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    assert main(["ppl", str(text), "--window", "64"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] > 100 and 1 < result["ppl"] < 50 and result["bits_per_byte"] > 0


def test_no_model_without_embedded_default(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("deltaspec.model.weights.default_model_path", lambda: tmp_path / "missing")
    assert main(["generate", "--prompt", PROMPT, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    line = assert_one_error_line(err)
    assert "embedded default model is not installed" in line
    assert "--model" in line
    assert out == ""


def test_generate_help_lists_engine_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--max-num-seqs",
        "--max-model-len",
        "--block-size",
        "--dtype",
        "--device",
        "--prompt",
        "--max-tokens",
        "--temperature",
        "--seed-sample",
        "--ignore-eos",
    ):
        assert flag in out, flag


def test_top_level_help_lists_generate(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "generate" in capsys.readouterr().out


def test_module_entry_point(text_checkpoint):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "deltaspec.cli", *generate_args(text_checkpoint, "--max-tokens", "2", "--ignore-eos")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(PROMPT)
    assert "new tokens: 2 " in stats_line(result.stderr)
