"""The fixed copy-bandwidth reference per device (`deltaspec.bench.reference`, `tools/device_reference.py`): its rule
on synthetic reports, the recorded file against the reports it names, and a CPU bench report carrying both rooflines
(the run's measured bandwidth and the device's reference, or a note when the device has none)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from deltaspec.bench import reference as ref
from deltaspec.cli import main

ROOT = Path(__file__).resolve().parents[2]


def decode(device, gb_s, **extra):
    return {"benchmark": "decode", "device": device, "bandwidth_gb_s": gb_s, **extra}


def test_the_reference_is_the_median_per_device_and_ignores_reports_without_a_measurement():
    reports = {
        "a/1.json": decode("NVIDIA H200", 4000.0),
        "a/2.json": decode("NVIDIA H200", 3700.0),
        "a/3.json": decode("NVIDIA H200", 4150.0),
        "b/1.json": decode("NVIDIA H100 80GB HBM3", 3000.0),
        "b/2.json": decode("NVIDIA H100 80GB HBM3", 3100.0),
        "c/verify.json": {"benchmark": "verify", "device": "NVIDIA H200"},  # no measured bandwidth
        "c/cpu.json": {"device": "cpu", "gb_s": 50.0},  # a kernel's bandwidth, not the copy's
        "c/bad.json": decode("NVIDIA H200", None),
        "c/list.jsonl": [decode("NVIDIA H200", 1.0)],
        "c/nodevice.json": {"bandwidth_gb_s": 1.0},
    }
    devices = ref.device_entries(reports)
    assert sorted(devices) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    h200, h100 = devices["NVIDIA H200"], devices["NVIDIA H100 80GB HBM3"]
    assert h200 == {
        "gb_s": 4000.0,
        "count": 3,
        "min_gb_s": 3700.0,
        "max_gb_s": 4150.0,
        "reports": ["a/1.json", "a/2.json", "a/3.json"],
    }
    assert h100["gb_s"] == 3050.0 and h100["count"] == 2 and h100["reports"] == ["b/1.json", "b/2.json"]


def test_a_recorded_device_keeps_its_reference_unless_refreshed():
    first = ref.reference_file({"x.json": decode("NVIDIA H200", 4000.0)})
    more = {"x.json": decode("NVIDIA H200", 4000.0), "y.json": decode("NVIDIA H200", 3000.0), "z.json": decode("B", 9)}
    kept = ref.reference_file(more, first)
    assert kept["devices"]["NVIDIA H200"]["gb_s"] == 4000.0 and kept["devices"]["B"]["gb_s"] == 9
    assert ref.reference_file(more, first, refresh=True)["devices"]["NVIDIA H200"]["gb_s"] == 3500.0
    assert kept["rule"] == ref.RULE


def test_the_tool_writes_the_file_from_the_reports_under_a_folder(tmp_path):
    root = tmp_path / "benchmarks"
    (root / "h200" / "abc").mkdir(parents=True)
    (root / "h200" / "abc" / "decode.json").write_text(json.dumps(decode("NVIDIA H200", 4100.0)))
    (root / "h200" / "abc" / "concurrency.json").write_text(json.dumps(decode("NVIDIA H200", 3900.0)))
    (root / "h200" / "abc" / "broken.json").write_text("{")
    out = root / "device-bandwidth.json"
    tool = [sys.executable, str(ROOT / "tools" / "device_reference.py"), "--root", str(root), "--out", str(out)]
    subprocess.run(tool, check=True, capture_output=True)
    entry = json.loads(out.read_text())["devices"]["NVIDIA H200"]
    assert entry["gb_s"] == 4000.0 and entry["count"] == 2
    assert entry["reports"] == ["benchmarks/h200/abc/concurrency.json", "benchmarks/h200/abc/decode.json"]


def test_the_recorded_file_follows_its_rule_from_the_reports_it_names():
    recorded = json.loads(ref.REFERENCE_FILE.read_text())
    assert recorded["rule"] == ref.RULE and recorded["devices"]
    for device, entry in recorded["devices"].items():
        measured = [ref.measured(json.loads((ROOT / name).read_text())) for name in entry["reports"]]
        assert all(m is not None and m[0] == device for m in measured), device
        values = [m[1] for m in measured]
        assert entry["gb_s"] == statistics.median(values) and entry["count"] == len(values)
        assert (entry["min_gb_s"], entry["max_gb_s"]) == (min(values), max(values))


def test_report_fractions_recompute_old_reports_from_their_own_numbers():
    reference = {"device": "D", "gb_s": 4000.0}
    old = {"benchmark": "decode", "decode_tok_s": 50.0, "bytes_per_step": 40e9, "roofline_fraction": 0.6}
    (row,) = ref.report_fractions(old, reference)
    assert row["reference_roofline_tok_s"] == pytest.approx(100.0)
    assert row["reference_roofline_fraction"] == pytest.approx(0.5) and row["measured_fraction"] == 0.6
    levels = [{"concurrency": 4, "aggregate_tok_s": 200.0, "bytes_per_step": 80e9}]
    (row,) = ref.report_fractions({"benchmark": "concurrency", "levels": levels}, reference)
    assert row["reference_roofline_tok_s"] == pytest.approx(200.0) and row["reference_roofline_fraction"] == 1.0


def test_an_unknown_device_has_no_reference_and_says_so(tmp_path):
    missing = ref.reference_for("cpu", tmp_path / "none.json")
    assert missing["gb_s"] is None and "no reference for device 'cpu'" in missing["note"]
    assert ref.reference_roofline(10.0, 1000, missing) == {
        "reference_roofline_tok_s": None,
        "reference_roofline_fraction": None,
    }


def bench(argv, tmp_path, capsys) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", *argv, "--device", "cpu", "--json", "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads(out.read_text())


DECODE = ["decode", "--context", "4", "--max-tokens", "3", "--runs", "1"]
CONCURRENCY = ["concurrency", "--context", "6", "--max-tokens", "3", "--concurrency", "1,2", "--runs", "1"]


def test_a_cpu_decode_report_says_the_device_has_no_reference(tmp_path, capsys):
    r = bench(DECODE, tmp_path, capsys)
    assert r["bandwidth_gb_s"] > 0 and r["roofline_fraction"] > 0  # the run's own measurement, as before
    assert r["reference_bandwidth"]["device"] == "cpu" and r["reference_bandwidth"]["gb_s"] is None
    assert "no reference for device 'cpu'" in r["reference_bandwidth"]["note"]
    assert r["reference_roofline_tok_s"] is None and r["reference_roofline_fraction"] is None


def test_decode_and_concurrency_reports_carry_both_rooflines(tmp_path, capsys, monkeypatch):
    file = tmp_path / "device-bandwidth.json"
    file.write_text(json.dumps(ref.reference_file({"r.json": decode("cpu", 25.0)})))
    monkeypatch.setattr(ref, "REFERENCE_FILE", file)
    r = bench(DECODE, tmp_path, capsys)
    assert r["reference_bandwidth"]["gb_s"] == 25.0 and r["reference_bandwidth"]["count"] == 1
    assert r["reference_roofline_tok_s"] == pytest.approx(25e9 / r["bytes_per_step"])
    assert r["reference_roofline_fraction"] == pytest.approx(r["decode_tok_s"] / r["reference_roofline_tok_s"])
    assert r["roofline_tok_s"] == pytest.approx(r["bandwidth_gb_s"] * 1e9 / r["bytes_per_step"])  # measured, kept
    (row,) = ref.report_fractions(r, r["reference_bandwidth"])  # the docs' recomputation agrees with the report
    assert row["reference_roofline_fraction"] == pytest.approx(r["reference_roofline_fraction"])

    c = bench(CONCURRENCY, tmp_path, capsys)
    assert c["reference_bandwidth"]["gb_s"] == 25.0 and c["bandwidth_gb_s"] > 0
    for level in c["levels"]:
        roofline = level["concurrency"] * 25e9 / level["bytes_per_step"]
        assert level["reference_roofline_tok_s"] == pytest.approx(roofline)
        assert level["reference_roofline_fraction"] == pytest.approx(level["aggregate_tok_s"] / roofline)
        assert level["roofline_fraction"] > 0


QUOTED = [  # (page, the figure as quoted, its report, streams, the percentage): fractions at the fixed reference
    ("README.md", "69.1 tok/s, 86.9 %", "benchmarks/h200/7241389/decode.json", 1, 86.9),
    ("README.md", "301.0 tok/s, 44.2 %", "benchmarks/h200/6f18e82/decode-35b-a3b.json", 1, 44.2),
    ("docs/performance.md", "69.1 tok/s = 86.9 % of 79.5 tok/s", "benchmarks/h200/7241389/decode.json", 1, 86.9),
    ("docs/performance.md", "| 4.13 TB/s | 87.5 % | 88.1 % |", "benchmarks/h200/decode-27b.json", 1, 88.1),
    ("docs/performance.md", "| 3.72 TB/s | 96.7 % | 87.7 % |", "benchmarks/h200/f51af8c/decode-27b.json", 1, 87.7),
    ("docs/performance.md", "| 3.94 TB/s | 89.4 % | 86.0 % |", "benchmarks/h200/f7ab47d/decode-27b.json", 1, 86.0),
    ("docs/performance.md", "301.0 tok/s = 44.2 % of 681", "benchmarks/h200/6f18e82/decode-35b-a3b.json", 1, 44.2),
    ("docs/performance.md", "11.6 % of its roofline", "benchmarks/h200/6f18e82/decode-35b-a3b-q4_k_m.json", 1, 11.6),
    ("docs/performance.md", "189.5 tok/s (11.4 %", "benchmarks/h200/3519570/concurrency-80b-a3b-q4_k_m.json", 1, 11.4),
    ("docs/performance.md", "2.73× (10.9 %", "benchmarks/h200/3519570/concurrency-80b-a3b-q4_k_m.json", 32, 10.9),
    ("docs/performance.md", "89.5 tok/s, 61.1 %", "benchmarks/h200/f7ab47d/decode-27b-fp8.json", 1, 61.1),
    ("docs/performance.md", "113.1 tok/s, 43.6 %", "benchmarks/h200/f7ab47d/decode-27b-int4.json", 1, 43.6),
    ("docs/performance.md", "66.2 tok/s, 26.0 %", "benchmarks/h200/1a1f950/decode-27b-q4_k_m.json", 1, 26.0),
]


@pytest.mark.parametrize(("page", "text", "report", "streams", "percent"), QUOTED, ids=lambda x: str(x)[:40])
def test_the_docs_quote_roofline_fractions_at_the_fixed_reference(page, text, report, streams, percent):
    assert text in (ROOT / page).read_text(encoding="utf-8"), f"{page} no longer quotes {text!r}"
    data = json.loads((ROOT / report).read_text())
    rows = {row["streams"]: row for row in ref.report_fractions(data, ref.reference_for(data["device"]))}
    assert round(100 * rows[streams]["reference_roofline_fraction"], 1) == percent
