"""The `deltaspec quantize` command: check the request, measure the importance on calibration text (when given),
write the GGUF file, and sum up what was written.

The model is a Hugging Face checkpoint directory or hub id, a float GGUF file, (none given) the embedded default
model, or with `--random-weights` a shape's random weights (`gguf_write_random`, drawn on `device`). Without
calibration text no importance is used, as llama-quantize without --imatrix; with it, the float model runs on
`device` in `dtype` over the text's windows first (refused for the float types and Q8_0, which use none).
Quantization runs on `device` too.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from deltaspec.config.engine import EngineConfig
from deltaspec.config.resolve import resolve_engine_config
from deltaspec.errors import DeltaspecError
from deltaspec.evaluate_kl import read_corpus, scoring_config
from deltaspec.llm import LLM
from deltaspec.model.gguf_write import FLOAT_TYPES, Importance, check_writable, parse_type, write_gguf
from deltaspec.model.gguf_write_names import gguf_importance, layout_for
from deltaspec.model.gguf_write_random import write_random_gguf
from deltaspec.model.gguf_write_source import Source, open_source
from deltaspec.model.shapes import SHAPES, shape_config
from deltaspec.quantize.imatrix import collect_importance


def calibrate(
    source: Source,
    model: str | None,
    files: list[str],
    window: int,
    max_windows: int | None,
    dtype: str,
    device: str,
) -> Importance:
    """The importance of `source`'s projections, measured by running `model` on the text of `files`."""
    if window < 16:
        raise DeltaspecError("--window must be at least 16 tokens, as llama-imatrix needs.")
    if max_windows is not None and max_windows < 1:
        raise DeltaspecError("--calibration-windows must be at least 1.")
    text = read_corpus(files)
    llm = LLM(
        progress=True, **scoring_config(EngineConfig.from_flat(model=model, dtype=dtype, device=device), window).flat()
    )
    means, windows = collect_importance(llm, text, window, max_windows)
    layout = layout_for(source.config, source.arch)
    values = dict(pair for name, mean in means.items() for pair in gguf_importance(name, mean, layout))
    return Importance(values, ", ".join(Path(f).name for f in files), windows)


def device_of(device: str) -> torch.device:
    """The torch device --device names ("auto": CUDA when there is one), or one sentence why not."""
    resolved = resolve_engine_config(EngineConfig.from_flat(device=device), None).host.device
    try:
        return torch.device(resolved)
    except RuntimeError:
        raise DeltaspecError(f"Unknown device {device!r}; use auto, cpu, cuda or cuda:N.") from None


def run_quantize(
    model: str | None,
    out: str,
    type_name: str,
    calibration: list[str] | None = None,
    calibration_windows: int | None = None,
    window: int = 512,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
) -> dict:
    """Write `model` as the GGUF file `out` with the tensor types of --type `type_name`; the summary."""
    kind = parse_type(type_name)
    if calibration and kind in (*FLOAT_TYPES, "Q8_0"):
        raise DeltaspecError(f"--type {type_name} uses no importance matrix; leave out --calibration.")
    path = Path(out)
    check_writable(path)
    quantize_device = device_of(device)
    source = open_source(model)
    start = time.perf_counter()
    importance = None
    if calibration:
        importance = calibrate(source, model, calibration, window, calibration_windows, dtype, device)
    calibrated = time.perf_counter()
    counts = write_gguf(source, path, kind, importance, quantize_device, progress)
    return {
        "output": str(path),
        "bytes": path.stat().st_size,
        "type": kind.lower(),
        "tensors": dict(counts.most_common()),
        "imatrix": None if importance is None else {"windows": importance.chunks, "entries": len(importance.values)},
        "seconds": {"calibration": calibrated - start, "writing": time.perf_counter() - calibrated},
    }


def run_random_quantize(
    shape: str | None, out: str, type_name: str, seed: int = 0, device: str = "auto", progress: bool = True
) -> dict:
    """Write the random weights of `shape` (seeded `seed`, drawn on `device`) as the GGUF file `out` with the tensor
    types of --type `type_name`; the summary."""
    if shape is None:
        raise DeltaspecError(f"--random-weights needs --shape NAME; the shapes are {', '.join(SHAPES)}.")
    kind = parse_type(type_name)
    config = shape_config(shape)
    path = Path(out)
    check_writable(path)
    start = time.perf_counter()
    counts = write_random_gguf(config, shape, path, kind, seed, device_of(device), progress)
    return {
        "output": str(path),
        "bytes": path.stat().st_size,
        "type": kind.lower(),
        "tensors": dict(counts.most_common()),
        "imatrix": None,
        "random": {"shape": shape, "seed": seed},
        "seconds": {"calibration": 0.0, "writing": time.perf_counter() - start},
    }


def summary_text(summary: dict) -> str:
    """The summary as the command prints it: file and size, the tensor types used, the time."""
    size = summary["bytes"]
    types = ", ".join(f"{qtype} {count}" for qtype, count in summary["tensors"].items())
    lines = [
        f"wrote {summary['output']} ({summary['type']}): {size / 2**20:.2f} MiB ({size:,d} bytes)",
        f"tensors: {sum(summary['tensors'].values())} ({types})",
    ]
    if (random := summary.get("random")) is not None:
        lines.append(f"random weights: shape {random['shape']}, seed {random['seed']}")
    seconds = summary["seconds"]
    if summary["imatrix"] is not None:
        imatrix = summary["imatrix"]
        lines.append(
            f"importance: {imatrix['entries']} tensors over {imatrix['windows']} windows in "
            f"{seconds['calibration']:.1f} s"
        )
    lines.append(f"time: {seconds['calibration'] + seconds['writing']:.1f} s")
    return "\n".join(lines)
