"""Combine what tools/peer_bench.sh measured in OUT_DIR into one JSON (OUT_DIR/peer_bench.json, also printed):
llama.cpp's and deltaspec's batch-1 decode, 512-token prefill and N-stream decode tok/s on the same GGUF file and
GPU, their ratios (deltaspec / llama.cpp), the GPU, deltaspec's commit and llama.cpp's build.

The pieces: `llama-bench.json` (llama-bench -o json: pp512 and tg128, means over its repetitions),
`llama-batched-bench.jsonl` (one line per stream count; `speed_tg` is the streams' generated tokens over the
generation time), `deltaspec-{decode,prefill,concurrency}.json` (`deltaspec bench ... --out`: medians over runs)
and `llama-source.txt` (the source tarball's name). A piece that is missing gives nulls and is listed in
`missing`.

    python3 tools/peer_bench.py OUT_DIR --shape qwen3.5-27b --type q4_k_m [--streams 32] [--file F.gguf]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPT = 512
GENERATED = 128


def read_json(path: Path, missing: list[str]):
    if not path.is_file():
        missing.append(path.name)
        return None
    return json.loads(path.read_text())


def read_jsonl(path: Path, missing: list[str]) -> list[dict]:
    """The JSON lines of a log that may hold other lines too."""
    if not path.is_file():
        missing.append(path.name)
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def llama_cpp(out: Path, streams: int, missing: list[str]) -> dict:
    """llama.cpp's numbers and build from llama-bench's and llama-batched-bench's output."""
    bench = read_json(out / "llama-bench.json", missing) or []
    pp = next((r for r in bench if r["n_prompt"] == PROMPT and r["n_gen"] == 0), None)
    tg = next((r for r in bench if r["n_prompt"] == 0 and r["n_gen"] == GENERATED), None)
    batched = {r["pl"]: r for r in read_jsonl(out / "llama-batched-bench.jsonl", missing)}
    source = out / "llama-source.txt"
    first = bench[0] if bench else {}
    return {
        "source": source.read_text().strip() if source.is_file() else None,
        "build_commit": first.get("build_commit"),
        "build_number": first.get("build_number"),
        "gpu_info": first.get("gpu_info"),
        "backends": first.get("backends"),
        "model_type": first.get("model_type"),
        "model_size": first.get("model_size"),
        "decode_tok_s": tg["avg_ts"] if tg else None,
        "decode_tok_s_stddev": tg["stddev_ts"] if tg else None,
        "prefill_512_tok_s": pp["avg_ts"] if pp else None,
        "prefill_512_tok_s_stddev": pp["stddev_ts"] if pp else None,
        f"streams_{streams}_tok_s": batched[streams]["speed_tg"] if streams in batched else None,
        "batched_1_stream_tok_s": batched[1]["speed_tg"] if 1 in batched else None,
        "commands": {
            "llama-bench": f"-ngl 99 -fa 1 -p {PROMPT} -n {GENERATED} -r 3",
            "llama-batched-bench": f"-ngl 99 -fa on -npp 128 -ntg {GENERATED} -npl 1,{streams}",
        },
    }


def deltaspec(out: Path, streams: int, missing: list[str]) -> dict:
    """deltaspec's numbers from its bench reports."""
    decode = read_json(out / "deltaspec-decode.json", missing) or {}
    prefill = read_json(out / "deltaspec-prefill.json", missing) or {}
    concurrency = read_json(out / "deltaspec-concurrency.json", missing) or {}
    lengths = {row["length"]: row for row in prefill.get("lengths", [])}
    levels = {row["concurrency"]: row for row in concurrency.get("levels", [])}
    return {
        "commit": decode.get("commit") or prefill.get("commit") or concurrency.get("commit"),
        "device": decode.get("device") or prefill.get("device") or concurrency.get("device"),
        "weight_blocks": decode.get("weight_blocks"),
        "decode_tok_s": decode.get("decode_tok_s"),
        "decode_roofline_fraction": decode.get("roofline_fraction"),
        "prefill_512_tok_s": lengths[PROMPT]["prefill_tok_s"] if PROMPT in lengths else None,
        f"streams_{streams}_tok_s": levels[streams]["aggregate_tok_s"] if streams in levels else None,
        "commands": {
            "decode": f"--context 128 --max-tokens {GENERATED} --runs 3",
            "prefill": f"--lengths {PROMPT} --runs 3",
            "concurrency": f"--concurrency 1,{streams} --context 128 --max-tokens {GENERATED} --runs 3",
        },
    }


def combine(out: Path, shape: str, qtype: str, streams: int, file: Path | None) -> dict:
    missing: list[str] = []
    ours, theirs = deltaspec(out, streams, missing), llama_cpp(out, streams, missing)
    keys = ("decode_tok_s", "prefill_512_tok_s", f"streams_{streams}_tok_s")
    ratios = {key: ours[key] / theirs[key] if ours[key] and theirs[key] else None for key in keys}
    return {
        "benchmark": "peer",
        "shape": shape,
        "type": qtype,
        "random_weights": True,
        "file_bytes": file.stat().st_size if file is not None and file.is_file() else None,
        "gpu": ours["device"] or theirs["gpu_info"],
        "commit": ours["commit"],
        "deltaspec": ours,
        "llama_cpp": theirs,
        "deltaspec_over_llama_cpp": ratios,
        "missing": missing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the OUT_DIR of tools/peer_bench.sh")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--type", required=True)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--file", type=Path, default=None, help="the GGUF file, for its size")
    args = parser.parse_args()
    report = combine(args.out, args.shape, args.type, args.streams, args.file)
    text = json.dumps(report, indent=1)
    (args.out / "peer_bench.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
