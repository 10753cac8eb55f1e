"""Summaries used by every benchmark: percentiles, medians, and the run's identity (device, dtype, commit)."""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path


def percentiles(values: list[float], points=(50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} of `values` (None when empty)."""
    if not values:
        return {f"p{p}": None for p in points} | {"mean": None}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}
    out["mean"] = statistics.fmean(values)
    return out


def commit() -> str | None:
    """The git commit of the deltaspec checkout, when it is one, with "-dirty" when tracked files differ from it
    (DELTASPEC_COMMIT overrides it, for copies of a checkout whose .git is stale or absent, such as a tree
    shipped to another machine)."""
    if os.environ.get("DELTASPEC_COMMIT"):
        return os.environ["DELTASPEC_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "describe", "--always", "--dirty", "--abbrev=7"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None
