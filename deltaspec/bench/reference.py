"""The fixed copy bandwidth per device that roofline fractions are quoted against.

Each device report measures the copy bandwidth in its own run (`bandwidth_gb_s`, from `device.copy_bandwidth`),
and that moves from run to run (3.72 to 4.17 TB/s on one H200 machine type), so a roofline fraction divided by it
moves with its denominator alone. `benchmarks/device-bandwidth.json` records one reference per device name, written
by `tools/device_reference.py` (never by hand) from the reports under `benchmarks/` by `RULE`, with the count, the
range and the report files it used. A device's entry, once recorded, stays (the tool adds devices it has not seen;
`--refresh` recomputes them all on purpose), so figures quoted against it stay comparable.

Reports carry both rooflines: the one at the bandwidth measured in the run (`roofline_tok_s`, `roofline_fraction`)
and the one at the device's reference (`reference_roofline_tok_s`, `reference_roofline_fraction`, with the
`reference_bandwidth` entry they used; both null, and the entry's `note` says why, when the file has no entry for
the device). No torch import: the tool and the tests read reports anywhere.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
REFERENCE_FILE = BENCHMARKS / "device-bandwidth.json"
RULE = (
    "per device name, the median of the copy bandwidth (bandwidth_gb_s) measured in every report under benchmarks/ "
    "that records one beside its device"
)


def measured(report: object) -> tuple[str, float] | None:
    """(device name, measured copy bandwidth in GB/s) of a report that records both at its top level, else None."""
    if not isinstance(report, dict):
        return None
    device, gb_s = report.get("device"), report.get("bandwidth_gb_s")
    if not isinstance(device, str) or isinstance(gb_s, bool) or not isinstance(gb_s, (int, float)) or gb_s <= 0:
        return None
    return device, float(gb_s)


def device_entries(reports: dict[str, object]) -> dict[str, dict]:
    """{device name: its reference entry} from `reports` ({file name: parsed report}) by `RULE`; reports without a
    measured bandwidth are ignored."""
    by_device: dict[str, list[tuple[str, float]]] = {}
    for name, report in sorted(reports.items()):
        if found := measured(report):
            by_device.setdefault(found[0], []).append((name, found[1]))
    return {
        device: {
            "gb_s": statistics.median(gb_s for _, gb_s in rows),
            "count": len(rows),
            "min_gb_s": min(gb_s for _, gb_s in rows),
            "max_gb_s": max(gb_s for _, gb_s in rows),
            "reports": [name for name, _ in rows],
        }
        for device, rows in sorted(by_device.items())
    }


def read_reports(root: Path = BENCHMARKS) -> dict[str, object]:
    """Every JSON report under `root` ({path relative to root's parent: parsed}), the reference file excepted; a
    file that does not parse is skipped."""
    reports = {}
    for path in sorted(root.rglob("*.json")):
        if path.name == REFERENCE_FILE.name:
            continue
        try:
            reports[path.relative_to(root.parent).as_posix()] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return reports


def reference_file(reports: dict[str, object], previous: dict | None = None, refresh: bool = False) -> dict:
    """The reference file's contents: `previous`'s device entries kept (unless `refresh`), devices it lacks added."""
    devices = device_entries(reports)
    if previous and not refresh:
        devices = {**devices, **previous.get("devices", {})}
    return {"rule": RULE, "written_by": "tools/device_reference.py", "devices": dict(sorted(devices.items()))}


def load(path: Path = REFERENCE_FILE) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def reference_for(device: str, path: Path | None = None) -> dict:
    """The `reference_bandwidth` entry a report carries: the device's recorded reference in `path` (default
    `REFERENCE_FILE`: `gb_s`, `count`, `file`), or `gb_s` null with a note saying why."""
    path = path or REFERENCE_FILE
    file = _shown(path)
    entry = ((load(path) or {}).get("devices") or {}).get(device)
    if not entry or not entry.get("gb_s"):
        note = f"{file} has no reference for device {device!r}; the reference_* rooflines are null"
        return {"device": device, "gb_s": None, "file": file, "note": note}
    return {"device": device, "gb_s": entry["gb_s"], "count": entry.get("count"), "rule": RULE, "file": file}


def reference_roofline(tok_s: float, bytes_step: int, reference: dict, streams: int = 1) -> dict:
    """The roofline of `streams` streams reading `bytes_step` a step at the reference bandwidth, and the share of it
    that `tok_s` (all streams together) reaches; both None without a reference."""
    if not reference.get("gb_s"):
        return {"reference_roofline_tok_s": None, "reference_roofline_fraction": None}
    roofline_tok_s = streams * reference["gb_s"] * 1e9 / bytes_step
    return {"reference_roofline_tok_s": roofline_tok_s, "reference_roofline_fraction": tok_s / roofline_tok_s}


def report_fractions(report: dict, reference: dict) -> list[dict]:
    """Each roofline figure of a report (decode, or each concurrency level) recomputed from its own rate and bytes
    per step against `reference` (a `reference_for` entry): what the docs quote, for old reports as for new ones."""
    rows = report.get("levels") if report.get("benchmark") == "concurrency" else [report]
    out = []
    for row in rows or []:
        tok_s = row.get("aggregate_tok_s", row.get("decode_tok_s"))
        if not tok_s or not row.get("bytes_per_step"):
            continue
        streams = row.get("concurrency", 1)
        measured_fraction = row.get("roofline_fraction")
        out.append(
            {"streams": streams, "tok_s": tok_s, "measured_fraction": measured_fraction}
            | reference_roofline(tok_s, row["bytes_per_step"], reference, streams)
        )
    return out


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    try:
        return path.relative_to(BENCHMARKS.parent).as_posix()
    except ValueError:
        return str(path)
