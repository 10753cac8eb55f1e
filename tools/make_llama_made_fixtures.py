"""Make tests/data/gguf_llama/: GGUF files written by llama.cpp's own tools, and what llama.cpp computes on them.

deltaspec's other GGUF fixtures are either the converter's float files or files deltaspec's own writer makes; a
misreading shared by that writer and the loader passes both. These are what users download: tiny models of the
three architectures (qwen35moe, qwen3next, qwen35), converted by llama.cpp's convert_hf_to_gguf.py to f32 and
quantized by llama-quantize, with llama.cpp's own next-token distributions on them.

The models are trained for a few minutes on the CPU (Python standard-library source, the tiny test tokenizer) so
that their next-token distributions are peaked as a language model's are: on a random model most positions are
near-ties, and 8-bit activations (llama.cpp's) flip their top token where a trained model's would not. MTP layers
(qwen35moe, qwen35) are random. Then, per case (`FILES`):

- presets quantized by llama-quantize, some with an importance matrix measured by llama-imatrix on
  calibration.txt (imatrix-* files: `quantize.imatrix.*` metadata, and the presets that need one);
- one file split into parts by llama-gguf-split (`--split-max-tensors`), kept only as its parts;
- llama-perplexity's `--kl-divergence-base` record of each file over calibration.txt (`CONTEXT`-token windows,
  `WINDOWS` of them: the log-softmax at positions c/2 .. c-2 of each window), stored in llama_logits.npz as
  tools/make_llama_logits.py stores its records;
- manifest.json: how each file was made (commands, llama.cpp build), its tensor types, the training run.

`--report FILE` instead quantizes each case with every preset llama-quantize lists (an imatrix where the preset
needs one; where llama-quantize refuses a very low-bit type for the NextN blocks, whose importance llama-imatrix
does not measure, the file converted without them), loads each file in deltaspec and writes, per file, whether
it loads and its agreement with llama-perplexity on the same file (top-1 and KL over `REPORT_WINDOWS` windows; as
deltaspec runs it, and with llama.cpp's 8-bit activations reproduced) — the survey behind docs/formats.md's list of
supported files. Usage, with a llama.cpp source tree and its build's bin/:

    .venv/bin/python tools/make_llama_made_fixtures.py /path/to/llama.cpp /path/to/llama.cpp/build/bin
    .venv/bin/python tools/make_llama_made_fixtures.py LLAMA_CPP BIN --report benchmarks/llama-quantize-presets-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.make_gguf_fixtures import convert, give_qwen_pre_tokenizer  # noqa: E402
from tools.make_gguf_write_oracles import run  # noqa: E402
from tools.make_llama_logits import perplexity_record  # noqa: E402

OUT = ROOT / "tests" / "data" / "gguf_llama"
CALIBRATION = ROOT / "tests" / "data" / "gguf_write" / "calibration.txt"
CONTEXT, WINDOWS = 64, 10  # 10 windows x 31 scored positions
REPORT_WINDOWS = 10
LINEAR_FIRST = ["linear_attention", "full_attention"]
# 256-wide rows (whole k-quant blocks), heads of 64 (llama.cpp's rotary sections), Hv = 2 Hk (the value-head
# reorder, and an out_proj block that spans all four value heads)
BASE = dict(
    vocab_size=400,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    layer_types=LINEAR_FIRST,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    eos_token_id=379,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
# case -> (transformers kind, config, MTP layers, llama.cpp pre-tokenizer)
CASES = {
    "qwen35moe": ("qwen3_5_moe", BASE | MOE, 1, "qwen35"),
    "qwen3next": ("qwen3_next", BASE | MOE, 0, "qwen2"),
    "qwen35": ("qwen3_5", BASE, 1, "qwen35"),
}
# case -> (preset, how): "" plain, "imatrix" with the measured importance matrix, "split" also split in parts
FILES = {
    "qwen35moe": [("Q4_K_M", ""), ("Q8_0", "split")],
    "qwen3next": [("Q4_K_M", ""), ("Q5_K_M", ""), ("IQ4_XS", "imatrix"), ("IQ2_M", "imatrix"), ("IQ1_M", "imatrix")],
    "qwen35": [("Q3_K_M", "")],
}
SPLIT_TENSORS = 16
TRAIN = dict(steps=1500, batch=16, length=128, lr=3e-3, warmup=50, seed=0, files=60)
NEEDS_IMATRIX = re.compile(r"^(IQ1|IQ2|IQ3_XXS|IQ3_XS|Q2_K_S|TQ|Q1_0|Q2_0)")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def corpus_text() -> tuple[str, list[str]]:
    """The training text: the first `TRAIN["files"]` modules of the running interpreter's standard library, in name
    order, leaving out textwrap.py (calibration.txt is its beginning)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(lib.glob("*.py")) if p.name != "textwrap.py"][: TRAIN["files"]]
    return "".join(p.read_text(errors="replace") for p in files), [p.name for p in files]


def train_checkpoint(case: str, directory: Path) -> dict:
    """Train `case`'s model on the corpus and save it (float32 safetensors, the tiny tokenizer with the Qwen split
    of its pre-tokenizer, MTP layers added at random); returns the run's record."""
    import tokenizers
    import torch

    from tests.tiny_models import add_mtp_weights, make_model
    from tests.tiny_tokenizer import write_tiny_tokenizer

    kind, config, mtp_layers, pre = CASES[case]
    write_tiny_tokenizer(directory)
    give_qwen_pre_tokenizer(directory, pre)
    text, files = corpus_text()
    ids = torch.tensor(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids)
    model = make_model(kind, TRAIN["seed"], **config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(TRAIN["seed"])
    steps, length, started, losses = TRAIN["steps"], TRAIN["length"], time.time(), []
    for step in range(steps):
        lr = TRAIN["lr"] * min(1.0, (step + 1) / TRAIN["warmup"]) * 0.5 * (1 + np.cos(np.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(ids) - length - 1, (TRAIN["batch"],), generator=gen)
        window = torch.stack([ids[s : s + length + 1] for s in starts.tolist()])
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"  {case} step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
    model.eval().save_pretrained(directory)
    if mtp_layers:
        add_mtp_weights(directory, num_layers=mtp_layers)
    return {
        **TRAIN,
        "corpus": f"Python {sys.version.split()[0]} standard library: {', '.join(files)}",
        "corpus_tokens": len(ids),
        "final_loss_mean_of_last_100": float(np.mean(losses[-100:])),
        "seconds": round(time.time() - started),
    }


def quantize(bin_dir: Path, f32: Path, out: Path, preset: str, imatrix: Path | None) -> list[str]:
    """Run llama-quantize; returns its argument list (for the manifest) with paths as file names."""
    args = [*(("--imatrix", imatrix) if imatrix else ()), f32, out, preset, "2"]
    log = run(bin_dir / "llama-quantize", *args)
    build = re.search(r"build = (\S+ \(\S+\))", log)
    return [
        "llama-quantize",
        *(Path(a).name if isinstance(a, Path) else a for a in args),
        *(build.groups() if build else ()),
    ]


def llama_version(bin_dir: Path) -> str:
    """The version line llama.cpp's tools print (the tree of ../shared/peers/ says 0.5.0-dev, commit unknown)."""
    found = re.search(r"^version: (.+)$", run(bin_dir / "llama-perplexity", "--version"), flags=re.M)
    return "llama.cpp " + (found[1] if found else "(version not printed)")


def record(bin_dir: Path, path: Path, work: Path, windows: int) -> dict[str, np.ndarray]:
    """llama-perplexity's record of `path` over `windows` windows of calibration.txt."""
    return perplexity_record(bin_dir, path, CALIBRATION, CONTEXT, windows, work)


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    names = [t.tensor_type.name for t in gguf.GGUFReader(path).tensors]
    return {name: names.count(name) for name in sorted(set(names))}


def prepare(llama_cpp: Path, bin_dir: Path, case: str, work: Path, nextn: bool = True) -> tuple[Path, Path, dict]:
    """`case`'s trained checkpoint, its f32 file (the converter's; with its MTP layers as NextN blocks unless
    `nextn` is False) and that file's imatrix (llama-imatrix's), made once in `work` (a later run with the same
    --work reuses them)."""
    hf_dir, trained = work / case / "hf", work / case / "training.json"
    dropped = CASES[case][2] > 0 and not nextn
    f32, imatrix = (work / case / f"{name}{'-no-nextn' if dropped else ''}.gguf" for name in ("f32", "imatrix"))
    if not trained.exists():
        trained.parent.mkdir(parents=True, exist_ok=True)
        trained.write_text(json.dumps(train_checkpoint(case, hf_dir)))
    if not f32.exists():
        no_mtp = ("--no-mtp",) if dropped or not CASES[case][2] else ()
        convert(llama_cpp, hf_dir.resolve(), CASES[case][3], f32, "f32", *no_mtp)
    if not imatrix.exists():
        run(bin_dir / "llama-imatrix", "-m", f32, "-f", CALIBRATION, "-c", CONTEXT, "--chunks", 8, "-t", "2",
            "-o", imatrix)  # fmt: skip
    return f32, imatrix, json.loads(trained.read_text())


def make_fixtures(llama_cpp: Path, bin_dir: Path, work: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.gguf"):
        old.unlink()
    manifest: dict = {"llama_cpp": llama_version(bin_dir), "calibration": CALIBRATION.name, "context": CONTEXT}
    manifest |= {"windows": WINDOWS, "cases": {}}
    arrays: dict[str, np.ndarray] = {}
    for case, files in FILES.items():
        f32, imatrix, training = prepare(llama_cpp, bin_dir, case, work)
        entry = manifest["cases"][case] = {"config": CASES[case][1], "mtp_layers": CASES[case][2]}
        entry["training"] = training
        entry["converter"] = f"convert_hf_to_gguf.py --outtype f32{'' if CASES[case][2] else ' --no-mtp'}"
        entry["files"] = {}
        for preset, how in files:
            stem = f"{case}-{preset.lower()}" + ("-imatrix" if how == "imatrix" else "")
            path = OUT / f"{stem}.gguf"
            with_imatrix = imatrix if how == "imatrix" else None
            made = entry["files"][stem] = {"command": quantize(bin_dir, f32, path, preset, with_imatrix)}
            made |= {"types": tensor_types(path), "bytes": path.stat().st_size, "sha256": sha256(path)}
            for key, value in record(bin_dir, path, work, WINDOWS).items():
                arrays[f"{stem}/{key}"] = value
            made["load"] = path.name
            if how == "split":  # only the parts are kept
                run(bin_dir / "llama-gguf-split", "--split", "--split-max-tensors", SPLIT_TENSORS, path, OUT / stem)
                path.unlink()
                parts = sorted(OUT.glob(f"{stem}-0*-of-*.gguf"))
                made["split"] = f"llama-gguf-split --split --split-max-tensors {SPLIT_TENSORS} {path.name} {stem}"
                made["parts"] = {p.name: sha256(p) for p in parts}
                made["load"] = parts[0].name
            print(f"{stem}: {made['bytes']:,d} bytes {made['types']}", flush=True)
    np.savez_compressed(OUT / "llama_logits.npz", **arrays)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for path in sorted(OUT.iterdir()):
        print(f"{path.stat().st_size:>10,d}  {path.relative_to(ROOT)}")


def presets(bin_dir: Path) -> list[str]:
    """The quantization types llama-quantize lists in its help, but the float ones and the aliases (Q4_K is
    Q4_K_M)."""
    shown = subprocess.run([str(bin_dir / "llama-quantize"), "--help"], capture_output=True, text=True)  # exits 1
    listed = re.findall(r"^\s+\d+\s+or\s+(\w+)\s+:\s*(.*)$", shown.stdout + shown.stderr, flags=re.M)
    skipped = ("F32", "F16", "BF16", "COPY")
    return list(dict.fromkeys(p for p, what in listed if p not in skipped and not what.startswith("alias")))


def agreement(path: Path, theirs: dict[str, np.ndarray]) -> dict:
    """deltaspec's float64 next-token distributions on `path` against llama-perplexity's record: as deltaspec runs
    the file (exact activations), and with llama.cpp's 8-bit activations reproduced (`tests.ggml_activations`)."""
    from deltaspec import LLM
    from tests.ggml_activations import ggml_activations
    from tests.gguf_records import kl_over_kept, log_probs_of, scored_log_probs

    want, kept = log_probs_of(theirs)
    out = {"positions": int(kept.shape[0] * kept.shape[1])}
    for name, context in (("exact_activations", contextlib.nullcontext), ("ggml_activations", ggml_activations)):
        with context():
            llm = LLM(str(path), dtype="float64", device="cpu", max_num_seqs=1, max_model_len=2 * CONTEXT)
            ours = scored_log_probs(llm.engine, theirs["tokens"])
        kl = kl_over_kept(want, ours, kept)
        top1 = (want.argmax(-1) == ours.argmax(-1)).double().mean()
        out[name] = {"top1": float(top1), "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}
    return out


def survey(llama_cpp: Path, bin_dir: Path, work: Path, report: Path) -> None:
    from deltaspec.errors import DeltaspecError

    every = presets(bin_dir)
    result: dict = {"tool": "tools/make_llama_made_fixtures.py --report", "llama_cpp": llama_version(bin_dir)}
    result |= {"presets": every, "windows": REPORT_WINDOWS, "context": CONTEXT, "cases": {}}
    for case in CASES:
        files = result["cases"][case] = {}
        for preset in every:
            files[preset] = entry = {}
            path = work / case / f"{preset}.gguf"
            for nextn in (True, False) if CASES[case][2] else (False,):
                f32, imatrix, _ = prepare(llama_cpp, bin_dir, case, work, nextn)
                try:
                    needs = imatrix if NEEDS_IMATRIX.match(preset) else None
                    entry["command"] = quantize(bin_dir, f32, path, preset, needs)
                    break
                except SystemExit as exc:  # very low-bit types want importance for the NextN blocks too, which
                    reason = re.search(r"failed to quantize: (.+)", str(exc))  # llama-imatrix does not run: then
                    refusal = reason[1].strip() if reason else str(exc).strip().splitlines()[-1][:300]  # without
                    entry["with_nextn_refused" if nextn else "llama_quantize_refused"] = refusal
            if "command" not in entry:
                print(f"{case} {preset}: llama-quantize refused", flush=True)
                continue
            entry["nextn_blocks"] = "with_nextn_refused" not in entry and CASES[case][2] > 0
            try:
                entry |= agreement(path, record(bin_dir, path, work / case, REPORT_WINDOWS))
                entry["types"] = tensor_types(path)
            except DeltaspecError as exc:
                entry["deltaspec_refused"] = str(exc)
            print(f"{case} {preset}: {json.dumps(entry)}", flush=True)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {report}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("bin_dir", type=Path, help="its build's bin/ (llama-quantize, -imatrix, -perplexity, -gguf-split)")
    ap.add_argument("--report", type=Path, help="survey every preset instead, writing this JSON report")
    ap.add_argument("--steps", type=int, default=TRAIN["steps"], help="training steps per model")
    ap.add_argument("--work", type=Path, help="keep the trained checkpoints and f32 files here to reuse them")
    args = ap.parse_args()
    TRAIN["steps"] = args.steps
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        if args.report:
            survey(args.llama_cpp.resolve(), args.bin_dir, work, args.report)
        else:
            make_fixtures(args.llama_cpp.resolve(), args.bin_dir, work)


if __name__ == "__main__":
    main()
