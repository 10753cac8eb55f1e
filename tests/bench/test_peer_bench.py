"""tools/peer_bench.py: the pieces tools/peer_bench.sh leaves in OUT_DIR combined into one JSON."""

from __future__ import annotations

import json

from tools.peer_bench import combine


def test_pieces_combine_into_one_report(tmp_path):
    bench = [
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 3000.0, "stddev_ts": 5.0, "build_commit": "unknown", "build_number": 0},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 80.0, "stddev_ts": 0.5, "gpu_info": "NVIDIA H100"},
    ]
    (tmp_path / "llama-bench.json").write_text(json.dumps(bench))
    lines = [json.dumps({"pl": pl, "speed_tg": tg}) for pl, tg in ((1, 78.0), (32, 640.0))]
    (tmp_path / "llama-batched-bench.jsonl").write_text("main: loading\n" + "\n".join(lines) + "\n")
    (tmp_path / "llama-source.txt").write_text("llama.cpp-2026-10-src.tar.xz (ggml 0.25.3)\n")
    ours = {"commit": "abc1234", "device": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "deltaspec-decode.json").write_text(json.dumps({**ours, "decode_tok_s": 72.0}))
    (tmp_path / "deltaspec-prefill.json").write_text(
        json.dumps({"lengths": [{"length": 512, "prefill_tok_s": 2400.0}]})
    )
    levels = [{"concurrency": 1, "aggregate_tok_s": 71.0}, {"concurrency": 32, "aggregate_tok_s": 520.0}]
    (tmp_path / "deltaspec-concurrency.json").write_text(json.dumps({"levels": levels}))
    report = combine(tmp_path, "qwen3.5-27b", "q4_k_m", 32, None)
    assert report["gpu"] == "NVIDIA H100 80GB HBM3" and report["commit"] == "abc1234" and report["missing"] == []
    assert report["llama_cpp"]["source"].endswith("(ggml 0.25.3)")
    assert report["llama_cpp"]["decode_tok_s"] == 80.0 and report["llama_cpp"]["streams_32_tok_s"] == 640.0
    assert report["deltaspec"]["prefill_512_tok_s"] == 2400.0 and report["deltaspec"]["streams_32_tok_s"] == 520.0
    assert report["deltaspec_over_llama_cpp"] == {
        "decode_tok_s": 0.9,
        "prefill_512_tok_s": 0.8,
        "streams_32_tok_s": 520.0 / 640.0,
    }


def test_missing_pieces_give_nulls(tmp_path):
    report = combine(tmp_path, "qwen3.5-27b", "q4_k_m", 32, None)
    assert report["deltaspec"]["decode_tok_s"] is None and report["llama_cpp"]["decode_tok_s"] is None
    assert set(report["missing"]) == {
        "llama-bench.json",
        "llama-batched-bench.jsonl",
        "deltaspec-decode.json",
        "deltaspec-prefill.json",
        "deltaspec-concurrency.json",
    }
    assert report["deltaspec_over_llama_cpp"]["decode_tok_s"] is None
