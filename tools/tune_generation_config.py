"""Choose the embedded model's default repetition penalty and token limit (its `generation_config.json`) on its
own held-out prompts, and write the measurements as a report.

The prompts are the chat requests the model was trained on, made from held-out functions it never saw
(tests/data/heldout_functions.json, CPython standard-library functions cut after their docstrings): "Write a
Python function `SIG` based on this description: SUMMARY" (tools/build_corpus.py's "describe" phrasing), thinking
off. For each repetition penalty the model answers all of them greedily, up to `--cap` tokens, and each answer is
scored: did it end by itself (an end-of-sequence token, not the cap), is its code valid Python (the first fenced
block, or the whole reply, parses), and does it loop (some 8-token run occurs three times or more). The penalty
with the most answers that end, parse and do not loop wins (the smaller on a tie), and the token limit is the
longest such answer's length at that penalty times 1.5, rounded up to a multiple of 64. Usage:

    .venv/bin/python tools/tune_generation_config.py --out benchmarks/generation-defaults-cpu-default-model.json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PENALTIES = (1.0, 1.05, 1.1, 1.15, 1.2, 1.3)
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.S)


def prompts() -> list[str]:
    """One chat request per held-out function: its signature and the first line of its docstring."""
    out = []
    for item in json.loads((ROOT / "tests" / "data" / "heldout_functions.json").read_text()):
        source = item["prompt"]
        signature = source.split("def ", 1)[1].split(":\n", 1)[0].rstrip()
        docstring = ast.get_docstring(ast.parse(source + "    pass\n").body[0]) or ""
        summary = docstring.strip().splitlines()[0] if docstring.strip() else item["name"]
        out.append(f"Write a Python function `{signature}` based on this description: {summary}")
    return out


def parses(text: str) -> bool:
    code = match[1] if (match := FENCE.search(text)) else text
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def loops(token_ids: list[int], width: int = 8, times: int = 3) -> bool:
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(token_ids) - width + 1):
        run = tuple(token_ids[i : i + width])
        counts[run] = counts.get(run, 0) + 1
        if counts[run] >= times:
            return True
    return False


def measure(llm, requests: list[str], penalty: float, cap: int) -> dict:
    from deltaspec import SamplingParams

    params = SamplingParams(max_tokens=cap, temperature=0.0, repetition_penalty=penalty)
    conversations = [[{"role": "user", "content": text}] for text in requests]
    started = time.time()
    outputs = llm.chat(conversations, params, chat_template_kwargs={"enable_thinking": False})
    answers = []
    for out in outputs:
        completion = out.outputs[0]
        ended = completion.finish_reason == "stop"
        answers.append(
            {
                "tokens": len(completion.token_ids),
                "ended": ended,
                "parses": parses(completion.text),
                "loops": loops(list(completion.token_ids)),
            }
        )
    good = [a for a in answers if a["ended"] and a["parses"] and not a["loops"]]
    lengths = sorted(a["tokens"] for a in answers)
    return {
        "repetition_penalty": penalty,
        "good": len(good),
        "ended": sum(a["ended"] for a in answers),
        "parse": sum(a["parses"] for a in answers),
        "loop": sum(a["loops"] for a in answers),
        "median_tokens": lengths[len(lengths) // 2],
        "longest_good_tokens": max((a["tokens"] for a in good), default=0),
        "seconds": round(time.time() - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    ap.add_argument("--cap", type=int, default=1024, help="tokens an answer may take while measuring")
    args = ap.parse_args()
    from deltaspec import LLM

    requests = prompts()
    llm = LLM(None, dtype="float32", device="cpu", max_num_seqs=len(requests), max_model_len=2048)
    rows = []
    for penalty in PENALTIES:
        rows.append(measure(llm, requests, penalty, args.cap))
        print(json.dumps(rows[-1]), flush=True)
    best = max(rows, key=lambda row: (row["good"], -row["repetition_penalty"]))
    limit = 64 * math.ceil(1.5 * best["longest_good_tokens"] / 64)
    report = {
        "tool": "tools/tune_generation_config.py",
        "model": "deltaspec/default_model/target",
        "prompts": len(requests),
        "cap": args.cap,
        "rows": rows,
        "chosen": {"repetition_penalty": best["repetition_penalty"], "max_new_tokens": limit},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["chosen"]))


if __name__ == "__main__":
    main()
