"""Summaries used by every benchmark: percentiles and medians (the run's commit: `deltaspec.provenance`)."""

from __future__ import annotations

import statistics


def percentiles(values: list[float], points=(50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} of `values` (None when empty)."""
    if not values:
        return {f"p{p}": None for p in points} | {"mean": None}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}
    out["mean"] = statistics.fmean(values)
    return out
