"""`deltaspec bench longctx` on the CPU with the embedded model: a small document leaves prefix checkpoints
(--prefix-checkpoint-min-prompt below its length), the follow-up reuses them with prefix caching on and
reuses nothing with it off; the report's fields are positive and its medians are the single run's values."""

import json

from deltaspec.cli import main

DOC, QUESTION, MAX_TOKENS = 600, 8, 4
SMALL = [
    "--doc-tokens",
    str(DOC),
    "--question-tokens",
    str(QUESTION),
    "--max-tokens",
    str(MAX_TOKENS),
    "--runs",
    "1",
    "--prefix-checkpoint-min-prompt",
    "256",
    "--device",
    "cpu",
]


def longctx(tmp_path, capsys, *flags) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", "longctx", *SMALL, *flags, "--json", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    (run,) = report["per_run"]
    assert report["benchmark"] == "longctx" and report["device"] == "cpu" and "commit" in report
    assert (report["doc_tokens"], report["question_tokens"], report["max_tokens"]) == (DOC, QUESTION, MAX_TOKENS)
    assert report["follow_up_prompt_tokens"] == run["follow_up_prompt_tokens"] == DOC + 2 * QUESTION + MAX_TOKENS
    assert report["max_model_len"] >= DOC + 2 * QUESTION + 2 * MAX_TOKENS
    for key in (
        "first_ttft_s",
        "first_decode_tok_s",
        "follow_up_ttft_s",
        "follow_up_decode_tok_s",
        "follow_up_num_cached_tokens",
    ):
        assert report[key] == run[key], key
    for key in ("first_ttft_s", "first_decode_tok_s", "follow_up_ttft_s", "follow_up_decode_tok_s"):
        assert report[key] > 0, key
    return report


def test_bench_longctx_follow_up_reuses_the_document(tmp_path, capsys):
    r = longctx(tmp_path, capsys)
    assert r["prefix_caching"] is True and r["prefix_checkpoint_min_prompt"] == 256
    assert 0 < r["follow_up_num_cached_tokens"] <= DOC + QUESTION + MAX_TOKENS


def test_bench_longctx_without_prefix_caching_reuses_nothing(tmp_path, capsys):
    r = longctx(tmp_path, capsys, "--no-prefix-caching")
    assert r["prefix_caching"] is False and r["follow_up_num_cached_tokens"] == 0


def test_bench_longctx_refuses_a_document_beyond_the_model_positions(capsys):
    assert main(["bench", "longctx", "--doc-tokens", "4090", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs 4282 positions, more than the model's 4096; use a smaller --doc-tokens" in err
    assert "Traceback" not in err


def test_bench_longctx_needs_two_new_tokens(capsys):
    assert main(["bench", "longctx", "--max-tokens", "1", "--device", "cpu"]) == 2
    assert "--max-tokens at least 2" in capsys.readouterr().err
