"""Write benchmarks/device-bandwidth.json: each device's fixed copy-bandwidth reference for roofline fractions.

    python tools/device_reference.py                  # add devices the file lacks, from the reports under benchmarks/
    python tools/device_reference.py --refresh        # recompute every device's entry (restates quoted fractions)
    python tools/device_reference.py --fractions R.json ...   # a report's rooflines against the reference

The rule (`deltaspec.bench.reference.RULE`): per device name, the median of the copy bandwidth measured in every
report under benchmarks/ that records one; the entry lists the count, the range and the reports used. An entry once
recorded stays, so the figures quoted against it stay comparable; `--fractions` prints what the docs quote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaspec.bench.reference import (  # noqa: E402
    BENCHMARKS,
    REFERENCE_FILE,
    load,
    read_reports,
    reference_file,
    reference_for,
    report_fractions,
)


def fractions(paths: list[str], reference_path: Path) -> None:
    for path in paths:
        report = json.loads(Path(path).read_text())
        reference = reference_for(report.get("device", "?"), reference_path)
        if reference["gb_s"] is None:
            print(f"{path}: {reference['note']}")
            continue
        for row in report_fractions(report, reference):
            measured = row["measured_fraction"]
            print(
                f"{path} C={row['streams']}: {row['tok_s']:.1f} tok/s = "
                f"{100 * row['reference_roofline_fraction']:.1f} % of {row['reference_roofline_tok_s']:.1f} tok/s "
                f"at {reference['gb_s'] / 1e3:.2f} TB/s ({reference['device']} reference)"
                + (f"; {100 * measured:.1f} % at the run's own bandwidth" if measured else "")
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=BENCHMARKS, help="the reports' folder (default: benchmarks/)")
    parser.add_argument("--out", type=Path, default=REFERENCE_FILE, help="the reference file to write")
    parser.add_argument("--refresh", action="store_true", help="recompute the devices already recorded too")
    parser.add_argument("--fractions", nargs="+", metavar="REPORT", help="print these reports' reference rooflines")
    args = parser.parse_args(argv)
    if args.fractions:
        fractions(args.fractions, args.out)
        return 0
    contents = reference_file(read_reports(args.root), load(args.out), args.refresh)
    args.out.write_text(json.dumps(contents, indent=1) + "\n")
    for device, entry in contents["devices"].items():
        print(
            f"{device}: {entry['gb_s']:.1f} GB/s, median of {entry['count']} reports "
            f"({entry['min_gb_s']:.1f} to {entry['max_gb_s']:.1f})"
        )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
