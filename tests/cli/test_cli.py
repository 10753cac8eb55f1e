"""The `deltaspec` command line, run in-process through `main()` and as `python -m deltaspec.cli`: positional and
flag forms, --help, --speculative-config, streamed generate / chat output with a stats line per answer, thinking."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from deltaspec import LLM, SamplingParams
from deltaspec.cli import build_parser, config_from_args, engine_config, main
from deltaspec.cli.generation import print_answer
from deltaspec.config.server import ServerConfig
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.model.weights import default_model_path
from deltaspec.server.reasoning import split_reasoning

PROMPT = "def add(a, b):"
REPO = Path(__file__).resolve().parents[2]


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


def with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def test_generate_greedy(text_checkpoint, capsys):
    assert main(generate_args(text_checkpoint, "--max-tokens", "8", "--ignore-eos", "--temperature", "0")) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT)
    expected = (
        LLM(str(text_checkpoint), dtype="float32", device="cpu")
        .generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert "\ufffd" in expected, "this completion was meant to hold bytes of a character split across tokens"
    assert out == with_newline(PROMPT + expected)
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
    def run(seed: int, flag: str = "--sample-seed") -> str:
        args = generate_args(
            text_checkpoint, "--max-tokens", "8", "--ignore-eos", "--temperature", "0.8", flag, str(seed)
        )
        assert main(args) == 0
        out, err = capsys.readouterr()
        assert "new tokens: 8 " in stats_line(err)
        return out

    first = run(3)
    assert first.startswith(PROMPT)
    assert run(3) == first
    assert run(3, "--seed-sample") == first  # the old spelling still works
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
    out, err = capsys.readouterr()
    assert out.strip() and out.endswith("\n")
    assert "new tokens: " in stats_line(err)
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
        "--sample-seed",
        "--ignore-eos",
        "--speculative-config",
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


def test_generate_takes_the_prompt_as_an_argument(text_checkpoint, capsys):
    flags = ["--model", str(text_checkpoint), "--device", "cpu", "--dtype", "float32", "--max-tokens", "4"]
    flags += ["--ignore-eos", "--temperature", "0"]
    assert main(["generate", PROMPT, *flags]) == 0
    positional = capsys.readouterr().out
    assert main(["generate", "--prompt", PROMPT, *flags]) == 0
    assert capsys.readouterr().out == positional
    assert main(["generate", PROMPT, "--prompt", PROMPT, *flags]) == 0  # the same text twice is fine
    assert capsys.readouterr().out == positional
    assert positional.startswith(PROMPT)


def test_generate_prompt_errors(capsys):
    assert main(["generate", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "needs a prompt" in assert_one_error_line(err) and out == ""
    assert main(["generate", "def f(", "--prompt", "def g(", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    line = assert_one_error_line(err)
    assert "'def f('" in line and "'def g('" in line and out == ""


def test_serve_takes_the_model_as_an_argument(capsys):
    args = build_parser().parse_args(["serve", "org/model", "--port", "9001", "--max-streams", "3"])
    engine, server = engine_config(args), config_from_args(args, ServerConfig)
    assert (engine.load.model, engine.scheduler.max_num_seqs, server.port) == ("org/model", 3, 9001)
    assert engine_config(build_parser().parse_args(["serve", "--model", "org/model"])).load.model == "org/model"
    both = build_parser().parse_args(["serve", "org/model", "--model", "org/model"])
    assert engine_config(both).load.model == "org/model"
    assert engine_config(build_parser().parse_args(["serve"])).load.model is None
    assert main(["serve", "org/a", "--model", "org/b", "--port", "1"]) == 2  # refused before any server starts
    out, err = capsys.readouterr()
    assert "'org/a'" in assert_one_error_line(err) and "--model" in err and out == ""


def option_entries(help_text: str) -> list[tuple[list[str], str]]:
    """(flags, description) of each option that an argparse --help text lists."""
    entries: list[tuple[list[str], str]] = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            invocation, _, description = line.strip().partition("  ")
            entries.append((re.findall(r"(?<![\w-])--?[a-z][\w-]*", invocation), description.strip()))
        elif entries and line.startswith("    "):
            entries[-1] = (entries[-1][0], f"{entries[-1][1]} {line.strip()}")
        elif not line.startswith(" "):
            entries.append(([], ""))  # a section header ends the entry before it
    return [entry for entry in entries if entry[0]]


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "plan"])
def test_help_lists_each_flag_once_with_one_default(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    entries = option_entries(text)
    counts = Counter(flag for flags, _ in entries for flag in flags)
    assert len(entries) > 20 and "--model" in counts and "--speculative-config" in counts
    assert [flag for flag, n in counts.items() if n > 1] == []
    assert not {"--max-streams", "--ctx", "--prefix-caching", "--no-prefix-caching", "--seed-sample"} & set(counts)
    for flags, description in entries:
        assert description.lower().count("default") <= 1, (flags, description)
    assert "(default: None)" not in text
    model_help = next(description for flags, description in entries if flags == ["--model"])
    assert model_help.endswith("(default: the embedded model)")


def test_hidden_aliases_still_work():
    args = build_parser().parse_args(["plan", "--max-streams", "3", "--ctx", "512", "--no-prefix-caching"])
    config = engine_config(args)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_model_len, config.cache.enable_prefix_caching) == (
        3,
        512,
        False,
    )
    assert engine_config(build_parser().parse_args(["plan", "--prefix-caching"])).cache.enable_prefix_caching is True


@pytest.mark.parametrize(
    "json_text, expected",
    [
        ('{"method": "ngram", "num_speculative_tokens": 5}', ("ngram", 5, None)),
        ('{"method": "mtp", "num_speculative_tokens": 2}', ("mtp", 2, None)),
        ('{"method": "qwen3_next_mtp", "num_speculative_tokens": 3}', ("mtp", 3, None)),
        ('{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 6}', ("draft", 6, "org/small")),
        ('{"model": "org/small"}', ("draft", 4, "org/small")),
        ('{"method": "draft+ngram"}', ("draft+ngram", 4, None)),
        (
            '{"method": "dflash", "model": "z-lab/q-DFlash", "num_speculative_tokens": 15}',
            ("block", 15, "z-lab/q-DFlash"),
        ),
        ('{"method": "block+ngram", "model": "dir"}', ("block+ngram", 4, "dir")),
    ],
)
def test_speculative_config_maps_to_the_drafter_flags(json_text, expected):
    for command in (["serve"], ["generate"], ["chat"], ["plan"], ["ppl", "f.txt"], ["bench", "decode"]):
        args = build_parser().parse_args([*command, "--speculative-config", json_text])
        config = engine_config(args)
        assert (
            config.speculation.speculative,
            config.speculation.draft_tokens,
            config.speculation.draft_model,
        ) == expected, command


def test_speculative_config_agrees_with_the_flags(capsys):
    args = build_parser().parse_args(
        ["plan", "--speculative", "ngram", "--draft-tokens", "5"]
        + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}']
    )
    assert (engine_config(args).speculation.speculative, engine_config(args).speculation.draft_tokens) == ("ngram", 5)
    base = ["plan", "--device", "cpu", "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "2"]

    def plan_lines() -> list[str]:  # the host's free memory and what fits in it, which other processes move, left out
        out = capsys.readouterr().out.splitlines()
        return [line for line in out if not line.startswith("free on") and "the most that fits" not in line]

    assert main([*base, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    from_json = plan_lines()
    assert main([*base, "--speculative", "mtp", "--draft-tokens", "2"]) == 0
    assert plan_lines() == from_json and any("mtp" in line for line in from_json)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--speculative-config", '{"method": "ngram",'], ["not valid JSON", "num_speculative_tokens"]),
        (["--speculative-config", '["ngram"]'], ["JSON object"]),
        (
            ["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 4}'],
            ["disable_by_batch_size", "method, model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max"],
        ),
        (["--speculative-config", '{"method": "mtp", "prompt_lookup_max": 4}'], ["n-gram", "'mtp'", "mtp+ngram"]),
        (
            ["--prompt-lookup-min", "3", "--speculative-config", '{"method": "ngram", "prompt_lookup_min": 2}'],
            ["--prompt-lookup-min 2", "--prompt-lookup-min 3"],
        ),
        (["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}'], ["<="]),
        (["--speculative-config", '{"method": "eagle3"}'], ["'eagle3'", "draft_model"]),
        (["--speculative-config", '{"num_speculative_tokens": 3}'], ["needs a method"]),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], ["at least 1", "0"]),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": true}'], ["at least 1", "True"]),
        (["--speculative-config", '{"method": "ngram", "model": "org/small"}'], ["model", "draft_model"]),
        (
            ["--draft-tokens", "3", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'],
            ["--draft-tokens 5", "--draft-tokens 3"],
        ),
        (["--speculative", "mtp", "--speculative-config", '{"method": "ngram"}'], ["'ngram'", "'mtp'"]),
    ],
)
def test_speculative_config_errors(flags, words, capsys):
    assert main(["plan", "--device", "cpu", *flags]) == 2
    out, err = capsys.readouterr()
    line = assert_one_error_line(err)
    assert out == ""
    for word in words:
        assert word in line, (word, line)


def test_sampling_flags_default_to_the_generation_config(text_checkpoint, tmp_path, capsys):
    def new_tokens(model: Path, *flags: str) -> tuple[str, str]:
        args = ["generate", PROMPT, "--model", str(model), "--device", "cpu", "--dtype", "float32", "--ignore-eos"]
        assert main([*args, *flags]) == 0
        out, err = capsys.readouterr()
        return out, re.search(r"new tokens: (\d+) ", stats_line(err)).group(1)

    model = tmp_path / "model"
    shutil.copytree(text_checkpoint, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "do_sample": False}))
    greedy, count = new_tokens(model)
    assert count == "5"
    assert greedy == new_tokens(model, "--temperature", "0", "--max-tokens", "5")[0]
    assert new_tokens(model, "--max-tokens", "3")[1] == "3"
    assert new_tokens(model, "--temperature", "1.5", "--sample-seed", "1")[0] != greedy
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    assert new_tokens(model)[1] == "64"  # no max_new_tokens: generate's own default


def test_generate_streams_before_it_exits():
    prompt = "def f("
    command = [sys.executable, "-m", "deltaspec.cli", "generate", prompt, "--device", "cpu", "--ignore-eos"]
    command += ["--max-tokens", "1000", "--temperature", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    received = b""
    try:
        while len(received) <= len(prompt) and (chunk := os.read(proc.stdout.fileno(), 4096)):
            received += chunk
        running = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert received.startswith(prompt.encode()) and len(received) > len(prompt)
    assert running  # the completion's first text came while the other ~1000 tokens were still being generated


def chat_prompt_tokens(capsys, *flags: str) -> int:
    assert main(["chat", "--message", "Write a function that adds two numbers.", "--max-tokens", "1", *flags]) == 0
    return int(re.search(r"prompt tokens: (\d+) ", stats_line(capsys.readouterr().err)).group(1))


def test_chat_follows_the_templates_thinking_default(capsys):
    tokenizer = Tokenizer.from_dir(default_model_path())
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]

    def rendered(**options) -> int:
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **options)))

    assert rendered(enable_thinking=True) != rendered(enable_thinking=False)
    assert chat_prompt_tokens(capsys) == rendered()
    assert chat_prompt_tokens(capsys, "--thinking") == rendered(enable_thinking=True)
    assert chat_prompt_tokens(capsys, "--no-thinking") == rendered(enable_thinking=False)


def test_chat_shows_reasoning_apart_and_keeps_only_the_answer(text_checkpoint, capsys, monkeypatch):
    """Two turns on stdin with --thinking: the reasoning on stderr, the answer on stdout, each with a stats line;
    the second prompt holds the first answer and not its reasoning."""
    llm = LLM(str(text_checkpoint), dtype="float32", device="cpu")
    tokenizer = llm.tokenizer
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = [{"role": "user", "content": "hello"}]
    text = llm.generate(tokenizer.apply_chat_template(first, enable_thinking=True), params)[0].outputs[0].text
    reasoning, answer = split_reasoning(text, started_in_thinking=True)
    assert reasoning
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
    second_prompt = tokenizer.apply_chat_template(second, enable_thinking=True)

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n\n"))
    flags = ["--model", str(text_checkpoint), "--dtype", "float32", "--device", "cpu", "--max-tokens", "12"]
    assert main(["chat", "--thinking", "--temperature", "0", *flags]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("> " + (with_newline(answer) if answer else ""))
    assert err.count(f"thinking:\n{reasoning}\n") >= 1
    stats = [line for line in err.splitlines() if "prompt tokens:" in line]
    assert len(stats) == 2
    assert f"prompt tokens: {len(tokenizer.encode(second_prompt))} " in stats[1]


@pytest.mark.parametrize(
    "deltas, in_thinking, shown_reasoning, answer",
    [
        (["Let me", " add.\n</th", "ink>\n\nIt is", " 4."], True, "thinking:\nLet me add.\n", "It is 4."),
        (["<think>\nhmm\n</think>\n\nok\n"], False, "thinking:\nhmm\n", "ok\n"),
        (["plain", " answer"], False, "", "plain answer"),
        (["cut off while thin", "king"], True, "thinking:\ncut off while thinking\n", ""),
    ],
)
def test_print_answer_separates_reasoning(deltas, in_thinking, shown_reasoning, answer):
    out, err = io.StringIO(), io.StringIO()
    assert print_answer(iter(deltas), in_thinking, out, err) == answer
    assert err.getvalue() == shown_reasoning
    assert out.getvalue() == (with_newline(answer) if answer else "")
