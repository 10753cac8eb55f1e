"""Cut the test fixtures for the default model out of the held-out split (standard-library files only,
PSF-licensed): a code sample for the perplexity test and function prompts (signature + docstring)
for the completion test. Run after tools/build_corpus.py."""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path


def function_prompts(text: str, limit: int) -> list[dict]:
    """Top-level functions with a docstring: the source up to the docstring's end, and the name."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.decorator_list:
            doc = node.body[0]
            if len(node.body) < 2 or doc.end_lineno - node.lineno > 12:
                continue
            out.append({"name": node.name, "prompt": "".join(lines[node.lineno - 1 : doc.end_lineno])})
        if len(out) >= limit:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", type=Path, default=Path("build/corpus/heldout_code.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("tests/data"))
    ap.add_argument("--sample-bytes", type=int, default=48_000)
    ap.add_argument("--functions", type=int, default=40)
    ap.add_argument("--per-file", type=int, default=3)
    args = ap.parse_args()

    rows = [json.loads(line) for line in args.heldout.read_text().splitlines()]
    stdlib = sorted((r for r in rows if r["source"] == "python-stdlib"), key=lambda r: r["path"])
    sample, files = "", []
    for row in stdlib:
        if len(sample) + len(row["text"]) <= args.sample_bytes:
            sample += row["text"]
            files.append(row["path"])
    prompts = []
    for row in stdlib:
        prompts += [{**p, "path": row["path"]} for p in function_prompts(row["text"], args.per_file)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heldout_code_sample.txt").write_text(sample)
    (args.out / "heldout_functions.json").write_text(json.dumps(prompts[: args.functions], indent=1))
    print(f"sample: {len(sample)} bytes from {files}; {min(len(prompts), args.functions)} function prompts")


if __name__ == "__main__":
    main()
