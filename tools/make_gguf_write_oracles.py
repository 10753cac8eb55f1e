"""Write tests/data/gguf_write/: what llama.cpp's own tools make of the checkpoints `deltaspec quantize` is tested on.

Each checkpoint (the tiny fixture families of tools/make_gguf_fixtures.py, a tiny Qwen3.5-MoE 256 wide so that
the k-quants apply to its experts, and the embedded default model) is converted to f32 by llama.cpp's
convert_hf_to_gguf.py (as make_gguf_fixtures does), then quantized by llama-quantize to every type deltaspec
writes: the presets, each block type with --pure, and some of them again with --imatrix. The imatrix is a
synthetic one (`synthetic_importance`: seeded values, counts of 1 so llama-quantize uses the values as they are,
one expert with count 0 so it uses ones there), which the tests rebuild. For the converter's own outtypes
(f16, bf16, q8_0) its files are recorded as well. oracles.json.gz keeps, per checkpoint, the tensor names in file
order, the f32 file's metadata, and per type each tensor's ggml type, its ggml shape and the first 8 hex digits of
the SHA-256 of its bytes, in the file's order (llama-quantize orders tensors by layer, then by name), the file's own
`general.file_type`, and the digest of the whole file.

It also runs llama-imatrix on the default model's f32 file over calibration.txt (8 windows of 128 tokens) and
keeps the mean squared inputs it measured (float16, imatrix-default.npz): the tests compare deltaspec's own
collection on the same windows. Last, llama.cpp runs files deltaspec wrote: llama-perplexity on the default
model's q8_0 and q4_k_m files (perplexity and KL divergence from the f32 file, recorded under "llama_cpp_runs").

    .venv/bin/python tools/make_gguf_write_oracles.py /path/to/llama.cpp /path/to/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "gguf_write"
CALIBRATION = OUT / "calibration.txt"
PRESETS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
PURE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")
IMATRIX_TYPES = ("Q4_K_M", "Q6_K", "Q2_K", "Q3_K", "Q4_0", "Q5_1", "IQ4_NL", "IQ4_XS")
CONVERTER_TYPES = ("f16", "bf16", "q8_0")
IMATRIX_CASES = ("qwen35moe-256", "default")
# a tiny Qwen3.5-MoE whose rows of 256 are whole k-quant blocks (routed experts' gate and up included)
WIDE_MOE = dict(
    vocab_size=400,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    layer_types=["linear_attention", "full_attention"],
    eos_token_id=379,
)
CASES = ("qwen35", "qwen35moe", "qwen3next", "qwen35moe-256", "default")
WINDOW, WINDOWS = 128, 8  # the llama-imatrix run on the default model


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


def write_case(directory: Path, case: str) -> tuple[Path, str]:
    """The Hugging Face checkpoint of `case` (built in `directory`, or the embedded model) and its pre-tokenizer."""
    from tests.tiny_models import write_checkpoint
    from tools.make_gguf_fixtures import FIXTURES, give_qwen_pre_tokenizer, write_hf_checkpoint

    if case == "default":
        return ROOT / "deltaspec" / "default_model" / "target", "qwen2"
    if case in FIXTURES:
        return write_hf_checkpoint(directory / case, case), FIXTURES[case][3]

    hf_dir = write_checkpoint(directory / case, "qwen3_5_moe", seed=0, tokenizer=True, **WIDE_MOE)
    give_qwen_pre_tokenizer(hf_dir, "qwen35")
    return hf_dir, "qwen35"


def synthetic_importance(tensors: list[tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """Seeded importance for every matrix of (GGUF name, torch shape): [cols] or [E, cols] float32 in (0.05, 20);
    the second expert of each expert stack gets ones (llama-quantize's value for an expert no token reached)."""
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in sorted(tensors):
        if len(shape) < 2 or not name.startswith("blk."):
            continue
        values = np.exp(rng.normal(0.0, 1.0, size=(*shape[:-2], shape[-1]))).astype(np.float32)
        if len(shape) == 3:
            values[1] = 1.0
        out[name] = values
    return out


def write_imatrix(path: Path, importance: dict[str, np.ndarray]) -> None:
    """An imatrix GGUF (llama-imatrix's format) whose means are `importance` exactly: sums = values, counts = 1 (an
    expert of all ones: count 0)."""
    writer = gguf.GGUFWriter(path, arch="")
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", ["synthetic"])
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", 1)
    for name, values in importance.items():
        counts = np.ones(values.shape[0] if values.ndim == 2 else 1, dtype=np.float32)
        if values.ndim == 2:
            counts[1] = 0.0
        writer.add_tensor(f"{name}.in_sum2", values)
        writer.add_tensor(f"{name}.counts", counts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_digests(path: Path) -> dict[str, str]:
    """GGUF tensor -> "TYPE:ne0xne1...:sha8" of its bytes, in the file's order; general.file_type; and "file": the
    sha8 of the whole file."""
    reader = gguf.GGUFReader(path)
    out = {
        t.name: f"{t.tensor_type.name}:{'x'.join(map(str, t.shape.tolist()))}:{digest(t.data.tobytes())}"
        for t in reader.tensors
    }
    out["general.file_type"] = int(reader.fields["general.file_type"].contents())
    out["file"] = digest(path.read_bytes())
    return out


def metadata(path: Path) -> dict:
    """Key -> value; long lists and the chat template as "sha8 of their JSON"."""
    out = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if (isinstance(value, list) and len(value) > 16) or (isinstance(value, str) and len(value) > 200):
            value = "sha8:" + digest(json.dumps(value, ensure_ascii=False).encode())
        out[key] = value
    return out


def run(*args: str | Path) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def quantize(bin_dir: Path, f32: Path, out: Path, qtype: str, *extra: str | Path) -> dict[str, str]:
    run(bin_dir / "llama-quantize", *extra, f32, out, qtype, "2")
    return tensor_digests(out)


def imatrix_means(path: Path) -> dict[str, np.ndarray]:
    """llama-quantize's reading of an imatrix file: sums / counts per entry (per expert), ones where a count is 0."""
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors}
    out = {}
    for name, sums in tensors.items():
        if name.endswith(".in_sum2"):
            base = name.removesuffix(".in_sum2")
            counts = tensors[base + ".counts"].reshape(-1)
            sums = sums.reshape(len(counts), -1)
            means = np.where(counts[:, None] > 0, sums / np.maximum(counts[:, None], 1), 1)
            out[base] = means[0] if len(counts) == 1 else means
    return out


def perplexity(bin_dir: Path, model: Path, text: Path, *extra: str | Path) -> dict:
    log = run(bin_dir / "llama-perplexity", "-m", model, "-f", text, "-c", WINDOW, "-t", "2", *extra)
    found = {}
    for key, pattern in (
        ("ppl", r"Final estimate: PPL = ([\d.]+)"),
        ("ppl", r"Mean PPL\(Q\)\s+:\s+([\d.]+)"),
        ("kl_mean", r"Mean\s+KLD:\s+([\d.]+)"),
        ("top1_agreement_percent", r"Same top p:\s+([\d.]+)"),
    ):
        if match := re.search(pattern, log):
            found[key] = float(match[1])
    return found


def llama_cpp_runs(bin_dir: Path, hf_dir: Path, f32: Path, tmp: Path) -> dict:
    """llama-perplexity on deltaspec's own q8_0 and q4_k_m files of the default model, against its f32 file."""
    from deltaspec.model.gguf_write import write_gguf
    from deltaspec.model.gguf_write_source import open_source

    text = ROOT / "tests" / "data" / "heldout_code_sample.txt"
    base = tmp / "base.kld"
    runs = {"f32 (converter)": perplexity(bin_dir, f32, text, "--kl-divergence-base", base)}
    for kind in ("Q8_0", "Q4_K_M"):
        mine = tmp / f"deltaspec-{kind}.gguf"
        write_gguf(open_source(str(hf_dir)), mine, kind, progress=False)
        runs[f"{kind.lower()} (deltaspec)"] = perplexity(
            bin_dir, mine, text, "--kl-divergence-base", base, "--kl-divergence"
        )
    return runs


def record_case(llama_cpp: Path, bin_dir: Path, case: str, tmp: Path) -> dict:
    """The f32 file of `case` and what the converter and llama-quantize write for it (see the module docstring)."""
    from tools.make_gguf_fixtures import convert

    hf_dir, pre = write_case(tmp / "hf", case)
    work = tmp / case
    work.mkdir()
    no_mtp = () if case in ("qwen35", "default") else ("--no-mtp",)
    f32 = work / "f32.gguf"
    convert(llama_cpp, hf_dir.resolve(), pre, f32, "f32", *no_mtp)
    shapes = [(t.name, tuple(int(n) for n in reversed(t.shape.tolist()))) for t in gguf.GGUFReader(f32).tensors]
    entry = {"tensors": [name for name, _ in shapes], "metadata": metadata(f32), "converter-f32": tensor_digests(f32)}
    for outtype in CONVERTER_TYPES:
        convert(llama_cpp, hf_dir.resolve(), pre, work / f"converter-{outtype}.gguf", outtype, *no_mtp)
        entry[f"converter-{outtype}"] = tensor_digests(work / f"converter-{outtype}.gguf")
    for qtype in PRESETS:
        entry[qtype] = quantize(bin_dir, f32, work / f"{qtype}.gguf", qtype)
    for qtype in PURE:
        entry[qtype] = quantize(bin_dir, f32, work / f"pure-{qtype}.gguf", qtype, "--pure")
    if case in IMATRIX_CASES:
        imatrix = work / "synthetic-imatrix.gguf"
        write_imatrix(imatrix, synthetic_importance(shapes))
        for qtype in IMATRIX_TYPES:
            pure = ("--pure",) if qtype in PURE else ()
            out = work / f"imatrix-{qtype}.gguf"
            entry[f"imatrix-{qtype}"] = quantize(bin_dir, f32, out, qtype, *pure, "--imatrix", imatrix)
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("bin_dir", type=Path, help="its build's bin/ (llama-quantize, llama-imatrix, llama-perplexity)")
    args = ap.parse_args()
    oracles: dict = {"cases": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for case in CASES:
            oracles["cases"][case] = entry = record_case(args.llama_cpp.resolve(), args.bin_dir, case, tmp)
            print(f"{case}: {len(entry) - 2} files recorded")
        f32 = tmp / "default" / "f32.gguf"
        measured = tmp / "default" / "imatrix.gguf"
        run(
            args.bin_dir / "llama-imatrix",
            "-m",
            f32,
            "-f",
            CALIBRATION,
            "-c",
            WINDOW,
            "--chunks",
            WINDOWS,
            "-t",
            "2",
            "-o",
            measured,
        )
        means = {name: values.astype(np.float16) for name, values in imatrix_means(measured).items()}
        np.savez_compressed(OUT / "imatrix-default.npz", **means)
        oracles["llama_cpp_runs"] = llama_cpp_runs(args.bin_dir, write_case(tmp, "default")[0], f32, tmp / "default")
        print(json.dumps(oracles["llama_cpp_runs"], indent=1))
    with gzip.open(OUT / "oracles.json.gz", "wt") as f:
        json.dump(oracles, f, separators=(",", ":"))
    for path in sorted(OUT.iterdir()):
        print(f"{path.stat().st_size:>9,d}  {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
