"""Record llama.cpp's next-token distributions on GGUF files, for `tests/gguf/test_gguf_llama_logits.py`.

llama-perplexity's `--kl-divergence-base FILE` saves, for each window of `-c` tokens, the log-softmax of the
logits at positions c/2 .. c-2 (each row as a float32 scale and minimum log-probability and one uint16 per
vocabulary entry, covering the top 16 nats), with the windows' tokens. This script runs it on files that
`deltaspec quantize`'s writer makes (byte-exact with llama.cpp's converter and llama-quantize, which
tests/gguf/test_gguf_write.py checks; llama.cpp cannot run the tiny fixtures of tests/data/gguf, whose rotary
sections do not fit their heads):

- the embedded default model (Qwen3.5, 8 layers) in f32, q8_0 and q4_k_m;
- a tiny Qwen3.5-MoE whose rows are whole 256-value blocks (`make_gguf_write_oracles.WIDE_MOE` with heads of 64,
  which llama.cpp's rotary sections need) in q4_k_m and q6_k, so routed experts and k-quant products are
  covered;

and stores each file's record as arrays in tests/data/gguf/llama_logits.npz (prefix = the file's stem):
tokens int32 [windows, c], quants uint16 [windows, rows, vocab], scale and min_log_prob float32 [windows, rows].
These files' tokenizers add no BOS, so each window is exactly its recorded tokens. Usage, with a llama.cpp
build's bin/:

    .venv/bin/python tools/make_llama_logits.py /path/to/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.make_gguf_fixtures import give_qwen_pre_tokenizer  # noqa: E402
from tools.make_gguf_write_oracles import WIDE_MOE, run, write_case  # noqa: E402

DATA = ROOT / "tests" / "data" / "gguf"
OUT = DATA / "llama_logits.npz"
TEXT = ROOT / "tests" / "data" / "gguf_write" / "calibration.txt"
CONTEXT, WINDOWS = 64, 2
FILES = (("default", "F32"), ("default", "Q8_0"), ("default", "Q4_K_M"), ("moe-256", "Q4_K_M"), ("moe-256", "Q6_K"))


def checkpoint_of(directory: Path, case: str) -> Path:
    """The Hugging Face checkpoint of `case`: the embedded default model, or "moe-256" built in `directory`."""
    if case == "default":
        return write_case(directory, case)[0]
    from tests.tiny_models import write_checkpoint

    hf_dir = directory / case
    if not hf_dir.exists():
        write_checkpoint(hf_dir, "qwen3_5_moe", seed=0, tokenizer=True, **WIDE_MOE, head_dim=64)
        give_qwen_pre_tokenizer(hf_dir, "qwen35")
    return hf_dir


def written_file(directory: Path, case: str, kind: str) -> Path:
    """The `kind` GGUF that deltaspec writes of `case` (the test rebuilds it alike): DIRECTORY/CASE-KIND.gguf."""
    from deltaspec.model.gguf_write import write_gguf
    from deltaspec.model.gguf_write_source import open_source

    path = directory / f"{case}-{kind.lower()}.gguf"
    if not path.exists():
        write_gguf(open_source(str(checkpoint_of(directory, case))), path, kind, progress=False)
    return path


def read_record(path: Path) -> dict[str, np.ndarray]:
    """llama-perplexity's `_logits_` file: header, tokens, then per window its rows of (scale, min, uint16s)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        sys.exit(f"{path} is not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, dtype=np.int32, count=3, offset=8)
    offset = 8 + 12
    tokens = np.frombuffer(raw, dtype=np.int32, count=n_chunk * n_ctx, offset=offset).reshape(n_chunk, n_ctx)
    offset += tokens.nbytes
    rows = n_ctx - 1 - n_ctx // 2
    width = 2 * ((n_vocab + 1) // 2) + 4  # uint16 per row: 2 floats, then the vocabulary, padded to even
    table = np.frombuffer(raw, dtype=np.uint16, count=n_chunk * rows * width, offset=offset)
    table = table.reshape(n_chunk, rows, width)
    floats = np.ascontiguousarray(table[..., :4]).view(np.float32)  # [windows, rows, 2]
    return {
        "tokens": tokens.copy(),
        "quants": np.ascontiguousarray(table[..., 4 : 4 + n_vocab]),
        "scale": floats[..., 0].copy(),
        "min_log_prob": floats[..., 1].copy(),
    }


def perplexity_record(bin_dir: Path, path: Path, text: Path, context: int, windows: int, work: Path) -> dict:
    """llama-perplexity's `--kl-divergence-base` record of `path` over `windows` windows of `context` tokens of
    `text` (`read_record`'s arrays); the file's tokenizer must add no BOS (deltaspec reads the file for that, so a
    file it cannot read is its one-sentence DeltaspecError)."""
    from deltaspec.model.gguf_raw import read_raw

    base = work / f"{path.stem}.kld"
    run(
        bin_dir / "llama-perplexity",
        "-m", path, "-f", text, "-c", context, "-b", context, "--chunks", windows, "-t", "2",
        "--kl-divergence-base", base,
    )  # fmt: skip
    if read_raw(path).metadata.get("tokenizer.ggml.add_bos_token"):
        sys.exit(f"{path} adds a BOS token, which llama-perplexity writes over each window's first token")
    return read_record(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bin_dir", type=Path, help="a llama.cpp build's bin/ (llama-perplexity)")
    args = ap.parse_args()
    arrays = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for case, kind in FILES:
            path = written_file(tmp, case, kind)
            for key, value in perplexity_record(args.bin_dir, path, TEXT, CONTEXT, WINDOWS, tmp).items():
                arrays[f"{path.stem}/{key}"] = value
            print(f"{path.stem}: {arrays[f'{path.stem}/quants'].shape}", flush=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
