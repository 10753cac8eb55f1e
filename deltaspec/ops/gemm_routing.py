"""The skinny-GEMM routing table: for each weight shape (N, K) of the model and each row-count bucket,
which implementation of `x @ weight.T` is fastest on this device — measured here, not inherited.

Candidates are torch's `F.linear` (cuBLAS on CUDA) and, on CUDA, each `skinny_linear` configuration
that handles the bucket's row count. A row count runs the route of the smallest bucket that holds
it; more rows than the largest bucket, or a shape that was not measured, go to `F.linear`.

The table is cached as JSON in `$DELTASPEC_CACHE_DIR` (default `~/.cache/deltaspec/`), one file per
(device name, torch version, triton version, dtype):

    {"format": 1, "device": ..., "torch": ..., "triton": ..., "dtype": "bfloat16",
     "buckets": [1, 2, ...], "candidates": ["torch", "dot-n64-k128-s1-w4-p4", ...],
     "shapes": {"<N>x<K>": {"<bucket>": {"best": "<candidate>", "ms": {"<candidate>": 0.0123, ...}}}}}

A file written with other buckets or another candidate list is measured again; shapes missing from
a file are measured and added. Tables measured on the development H200 ship in `gemm_tables/` and are
read when the cache has no file for the same device and versions. The same timings give `pass_cost_ms`
and `relative_costs`, which the draft-length policy reads as the device's verify-cost curve. A cache that
cannot be read or written (read-only, full) never stops an engine from starting: a warning, and the table is
measured for this run.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib.metadata
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TORCH_PATH = "torch"
FORMAT_VERSION = 1
CPU_REPEATS = 5

Shape = tuple[int, int]  # (N, K) of a weight [N, K]
# Tables measured on the development GPU with the versions in their names, shipped like vLLM's tuned
# kernel configs: an identical device and software stack skips the first-run measurement (the user's
# own cache still wins, and any other stack measures).
SHIPPED_TABLES = Path(__file__).resolve().parent / "gemm_tables"

log = logging.getLogger("deltaspec.ops")


def cache_dir() -> Path:
    """Where routing tables live: $DELTASPEC_CACHE_DIR, else ~/.cache/deltaspec."""
    return Path(os.environ.get("DELTASPEC_CACHE_DIR") or Path.home() / ".cache" / "deltaspec")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _candidates(device: torch.device) -> dict[str, tuple[Callable, int]]:
    """name -> (callable(x, weight), most rows it handles): F.linear, and on CUDA each skinny
    configuration (the kernels need a GPU)."""
    candidates = {TORCH_PATH: (F.linear, sys.maxsize)}
    if device.type == "cuda":
        from deltaspec.ops.triton import skinny_gemm

        candidates.update(
            {
                config.name: (functools.partial(skinny_gemm.skinny_linear, config=config), config.max_rows)
                for config in skinny_gemm.SKINNY_CONFIGS
            }
        )
    return candidates


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of one call of `fn` in milliseconds: CUDA events with warm-up and an L2 flush
    before each call (triton.testing.do_bench) on CUDA, the wall clock on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=30, return_mode="median"))
    fn()
    samples = []
    for _ in range(CPU_REPEATS):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


class GemmRouter:
    """The measured routing table for one device and dtype, over the weight shapes of a model.

    `shapes`: (N, K) -> how many weights of that shape one forward pass reads (the multiplicity
    weighs `pass_cost_ms`). Construction loads the cached table, measuring (with a progress bar on
    stderr) only what the cache lacks; `measured` says whether anything was measured."""

    def __init__(
        self,
        shapes: dict[Shape, int],
        dtype: torch.dtype,
        device: torch.device | str = "cuda",
        cache_root: str | Path | None = None,
        show_progress: bool = True,
    ):
        self.shapes = {(int(n), int(k)): int(count) for (n, k), count in shapes.items()}
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.candidates = _candidates(self.device)
        self.path = Path(cache_root or cache_dir()) / self._file_name()
        self.table = self._load()  # (N, K) -> bucket -> {"best": name, "ms": {name: ms}}
        missing = [shape for shape in self.shapes if shape not in self.table]
        self.measured = bool(missing)
        if missing:
            self.table.update(self._measure(missing, show_progress))
            self._save()
        self._routes = {shape: self._routes_by_rows(shape) for shape in self.shapes}

    def adopt(self, table: dict[Shape, dict[int, dict]]) -> None:
        """Route by another process's measured `table` where it has a shape (by this one's elsewhere): pipeline
        stages multiply the weights they all hold (LM head, MTP head) by the same kernels, so their logits agree."""
        self.table = {**self.table, **table}
        self._routes = {shape: self._routes_by_rows(shape) for shape in self.shapes}

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` for x [..., K], weight [N, K], by the route measured for x's row count."""
        routes = self._routes.get(weight.shape)
        rows = math.prod(x.shape[:-1])
        if (
            routes is None
            or not 0 < rows <= ROW_BUCKETS[-1]
            or x.dtype != self.dtype
            or weight.dtype != self.dtype
            or weight.stride(-1) != 1
        ):
            return F.linear(x, weight)
        if x.dim() == 2:
            return routes[rows](x, weight)
        return routes[rows](x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])

    def route(self, shape: Shape, rows: int) -> str:
        """The name of the path `linear` takes for `rows` rows of a weight of `shape`."""
        if shape not in self.table or not 0 < rows <= ROW_BUCKETS[-1]:
            return TORCH_PATH
        return self.table[shape][_bucket(rows)]["best"]

    def pass_cost_ms(self, rows: int) -> float:
        """Time of the model's skinny GEMMs for a pass of `rows` rows: the best measured time of each
        shape times its multiplicity, interpolated linearly between buckets (and extrapolated from the
        last two beyond the largest)."""
        return sum(count * self._best_ms(shape, rows) for shape, count in self.shapes.items())

    def relative_costs(self, max_rows: int, other_bytes: Callable[[int], float] | None = None) -> tuple[float, ...]:
        """The time of a pass of r rows relative to one row, r = 1..max_rows: `pass_cost_ms(r)` plus, where
        `other_bytes(r)` gives the bytes the pass reads outside the routed GEMMs (a MoE model's experts), those
        bytes at `bytes_per_ms`."""

        per_ms = self.bytes_per_ms() if other_bytes else 0.0

        def pass_ms(rows: int) -> float:
            return self.pass_cost_ms(rows) + (other_bytes(rows) / per_ms if other_bytes else 0.0)

        base = pass_ms(1)
        return tuple(pass_ms(rows) / base for rows in range(1, max_rows + 1))

    def bytes_per_ms(self) -> float:
        """The bandwidth the table measured at one row: the largest weight's bytes over its best time."""
        n, k = max(self.shapes, key=lambda shape: shape[0] * shape[1])
        return n * k * self.dtype.itemsize / self._best_ms((n, k), 1)

    def _best_ms(self, shape: Shape, rows: int) -> float:
        best = [min(self.table[shape][bucket]["ms"].values()) for bucket in ROW_BUCKETS]
        upper = min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)
        if ROW_BUCKETS[upper] == rows:
            return best[upper]
        lower = max(upper - 1, 0)
        if lower == upper:
            return best[upper]
        span = ROW_BUCKETS[upper] - ROW_BUCKETS[lower]
        return best[lower] + (best[upper] - best[lower]) * (rows - ROW_BUCKETS[lower]) / span

    def _routes_by_rows(self, shape: Shape) -> tuple[Callable, ...]:
        """Index r (1..64) -> the callable for r rows (index 0 unused)."""
        by_bucket = {bucket: self.candidates[entry["best"]][0] for bucket, entry in self.table[shape].items()}
        return (F.linear, *(by_bucket[_bucket(rows)] for rows in range(1, ROW_BUCKETS[-1] + 1)))

    def _measure(self, shapes: list[Shape], show_progress: bool) -> dict[Shape, dict[int, dict]]:
        measured = {}
        with tqdm(
            total=len(shapes) * len(ROW_BUCKETS),
            desc="Measuring GEMM routes",
            unit="case",
            file=sys.stderr,
            disable=not show_progress,
        ) as progress:
            for n, k in shapes:
                weight = torch.randn(n, k, device=self.device, dtype=self.dtype)  # [N, K]
                measured[(n, k)] = {}
                for bucket in ROW_BUCKETS:
                    x = torch.randn(bucket, k, device=self.device, dtype=self.dtype)  # [rows, K]
                    times = {
                        name: self._time_candidate(fn, x, weight)
                        for name, (fn, max_rows) in self.candidates.items()
                        if bucket <= max_rows
                    }
                    times = {name: ms for name, ms in times.items() if ms is not None}
                    measured[(n, k)][bucket] = {"best": min(times, key=times.get), "ms": times}
                    progress.update()
                del weight
        return measured

    def _time_candidate(self, fn: Callable, x: torch.Tensor, weight: torch.Tensor) -> float | None:
        """Milliseconds per call, or None when the candidate cannot run this shape (a configuration
        that does not compile for this device, e.g. one needing more shared memory than it has)."""
        try:
            if fn is not F.linear and not _agrees(fn(x, weight), F.linear(x, weight)):
                raise ValueError("its result differs from torch's")
            return time_ms(lambda: fn(x, weight), self.device)
        except Exception as error:  # any failure only removes the candidate
            if fn is F.linear:
                raise
            print(
                f"gemm routing: skipping a candidate for {tuple(x.shape)} @ {tuple(weight.shape)}.T: {error}",
                file=sys.stderr,
            )
            return None

    def _file_name(self) -> str:
        key = (
            f"gemm-routes_{_device_name(self.device)}_torch-{torch.__version__}"
            f"_triton-{_version('triton')}_{str(self.dtype).removeprefix('torch.')}"
        )
        return re.sub(r"[^A-Za-z0-9_.+-]+", "-", key) + ".json"

    def _header(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "device": _device_name(self.device),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "dtype": str(self.dtype).removeprefix("torch."),
            "buckets": list(ROW_BUCKETS),
            "candidates": list(self.candidates),
        }

    def _load(self) -> dict[Shape, dict[int, dict]]:
        """The cached table (the user's cache first, then the tables shipped in `SHIPPED_TABLES`), or an
        empty one when neither has a file written for this device, versions, buckets and candidates."""
        for path in (self.path, SHIPPED_TABLES / self.path.name):
            try:
                data = json.loads(path.read_text())
            except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):  # absent, or not JSON
                continue
            except (OSError, UnicodeDecodeError) as exc:  # unreadable: measured again, as if absent
                log.warning("Cannot read the GEMM routing table %s (%s); it is measured again.", path, _reason(exc))
                continue
            if {key: data.get(key) for key in self._header()} == self._header():
                return self._table_of(data)
        return {}

    @staticmethod
    def _table_of(data: dict) -> dict[Shape, dict[int, dict]]:
        table = {}
        for key, by_bucket in data["shapes"].items():
            n, k = (int(part) for part in key.split("x"))
            table[(n, k)] = {int(bucket): entry for bucket, entry in by_bucket.items()}
        return table

    def _save(self) -> None:
        """Write the table to the cache (a temporary file renamed into place). A cache that cannot be written
        (read-only, full, not a directory) costs only the saving: one warning, the engine runs on the table it
        measured, and the next start measures again."""
        shapes = {
            f"{n}x{k}": {str(bucket): entry for bucket, entry in by_bucket.items()}
            for (n, k), by_bucket in sorted(self.table.items())
        }
        partial = self.path.with_suffix(".json.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({**self._header(), "shapes": shapes}, indent=1))
            partial.replace(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            log.warning(
                "Cannot save the GEMM routing table to %s (%s); this run uses the table it measured and the next "
                "start measures again (point DELTASPEC_CACHE_DIR at a writable directory to keep it).",
                self.path,
                _reason(exc),
            )


def _reason(exc: Exception) -> str:
    """An OS error's own words ("No space left on device"), else the exception's message."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _agrees(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """A candidate's product matches torch's within 16-bit rounding (a kernel that is fast but wrong on
    this device must never be routed to)."""
    scale = expected.float().abs().max().clamp(min=1.0)
    return bool(((got.float() - expected.float()).abs().max() <= 2e-2 * scale).item())


def _bucket(rows: int) -> int:
    """The smallest bucket holding `rows` rows (rows <= ROW_BUCKETS[-1])."""
    return ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, rows)]
