"""Write the tiny GGUF test fixtures (tests/data/gguf/) with llama.cpp's own converter.

Each fixture starts as a tiny random Hugging Face checkpoint (`tests.tiny_models.write_checkpoint`, a fixed
seed, the tiny tokenizer), which `convert_hf_to_gguf.py --outtype ...` turns into a `.gguf`; the tests rebuild
the same checkpoint with `write_hf_checkpoint` (it is deterministic) and compare. Usage:

    .venv/bin/python tools/make_gguf_fixtures.py /path/to/llama.cpp

The converter names the pre-tokenizer by hashing how the tokenizer encodes a check text, which only full-size
vocabularies can match; the tiny tokenizer is given the exact Qwen split regex (and NFC normalizer) that the name
stands for, and the converter is told that name instead of looking the hash up (`BOOTSTRAP`). Nothing else of the
converter is changed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "gguf"

# the regexes of the Qwen tokenizer.json files, which llama.cpp's pre-tokenizers "qwen2" and "qwen35" stand for
QWEN_SPLIT = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",  # noqa: E501
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",  # noqa: E501
}

# fixture family -> (transformers kind, config overrides, MTP layers, pre-tokenizer, outtypes). The shapes are
# tiny but keep Hv = r * Hk with r > 1 (the value-head reorders) and rows of 32 (Q8_0 blocks) where they matter:
# qwen35 has value heads of one Q8_0 block (32), qwen35moe of a quarter block (8), qwen3next r = 3.
TOKENIZER_VOCAB = 384  # tests.tiny_tokenizer's default: the model vocabularies below pad it, as real ones do
IM_END = TOKENIZER_VOCAB - 5  # `<|im_end|>`: the tiny tokenizer puts its 7 added tokens last
SMALL = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, eos_token_id=IM_END)
LINEAR_FIRST = ["linear_attention", "full_attention"]
FIXTURES = {
    "qwen35": (
        "qwen3_5",
        dict(
            SMALL, linear_key_head_dim=32, linear_value_head_dim=32, layer_types=["linear_attention", "full_attention"]
        ),
        1,
        "qwen35",
        ("f32", "f16", "bf16", "q8_0"),
    ),
    "qwen35moe": (
        "qwen3_5_moe",
        dict(SMALL, tie_word_embeddings=True, layer_types=["full_attention", "linear_attention"]),
        0,
        "qwen35",
        ("f32", "q8_0"),
    ),
    "qwen3next": (
        "qwen3_next",
        dict(SMALL, linear_num_value_heads=6, layer_types=LINEAR_FIRST),
        0,
        "qwen2",
        ("f32", "q8_0"),
    ),
}
SPLIT = ("qwen3next", "q8_0", 12)  # also written as NAME-0000i-of-0000n.gguf parts of at most 12 tensors

BOOTSTRAP = """
import runpy, sys
llama_cpp, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [llama_cpp + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def write_hf_checkpoint(directory: Path, family: str) -> Path:
    """The Hugging Face checkpoint the `family` fixtures are converted from (deterministic: seed 0)."""
    from tests.tiny_models import add_mtp_weights, write_checkpoint

    kind, overrides, mtp_layers, pre, _ = FIXTURES[family]
    write_checkpoint(directory, kind, seed=0, tokenizer=True, **overrides)
    if mtp_layers:
        add_mtp_weights(directory, num_layers=mtp_layers)
    give_qwen_pre_tokenizer(directory, pre)
    return directory


def give_qwen_pre_tokenizer(hf_dir: Path, pre: str) -> None:
    """Make the tiny tokenizer of `hf_dir` split text as llama.cpp's pre-tokenizer `pre` ("qwen2" or "qwen35")
    does: that regex and the NFC normalizer, so that GGUF files can be written of the checkpoint."""
    tokenizer_file = hf_dir / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    tokenizer["normalizer"] = {"type": "NFC"}
    tokenizer["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT[pre]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    tokenizer_file.write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2))


def convert(llama_cpp: Path, hf_dir: Path, pre: str, outfile: Path, outtype: str, *extra: str) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py (with its own gguf-py) on `hf_dir`."""
    args = [str(hf_dir), "--outtype", outtype, "--outfile", str(outfile), *extra]
    subprocess.run([sys.executable, "-c", BOOTSTRAP, str(llama_cpp), pre, *args], check=True, cwd=hf_dir.parent)


def converter_arguments(description: str, out: Path) -> tuple[Path, Path]:
    """The llama.cpp source directory and the output directory a fixture script is given (it exits, saying why,
    when the directory holds no convert_hf_to_gguf.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--out", type=Path, default=out)
    args = ap.parse_args()
    llama_cpp = args.llama_cpp.resolve()
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{llama_cpp} has no convert_hf_to_gguf.py; pass the llama.cpp source directory.")
    return llama_cpp, args.out


def main() -> None:
    llama_cpp, out = converter_arguments(__doc__.splitlines()[0], OUT)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family, (_, _, _, pre, outtypes) in FIXTURES.items():
            hf_dir = write_hf_checkpoint(Path(tmp) / family, family)
            # the converter insists on an MTP head for these architectures unless told there is none
            no_mtp = () if FIXTURES[family][2] else ("--no-mtp",)
            for outtype in outtypes:
                convert(llama_cpp, hf_dir, pre, out / f"{family}-{outtype}.gguf", outtype, *no_mtp)
            if family == SPLIT[0]:
                outfile = out / f"{family}-{SPLIT[1]}-split.gguf"
                convert(llama_cpp, hf_dir, pre, outfile, SPLIT[1], "--split-max-tensors", str(SPLIT[2]), *no_mtp)
    for path in sorted(out.glob("*.gguf")):
        print(f"{path.stat().st_size:>9,d}  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
