"""The serving benchmarks run end to end on the CPU and report what DESIGN §6 defines."""

import json

from deltaspec.cli import main


def test_bench_serve_reports_aggregate_rate_and_percentiles(tmp_path, capsys):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.svg"
    assert (
        main(
            [
                "bench",
                "serve",
                "--concurrency",
                "1,2",
                "--requests-per-client",
                "2",
                "--max-tokens",
                "6",
                "--runs",
                "2",
                "--device",
                "cpu",
                "--out",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["benchmark"] == "serve" and report["device"] == "cpu" and report["dtype"] == "float32"
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert len(level["runs"]) == 2
        for run in level["runs"]:
            assert run["requests"] == 2 * level["concurrency"]
            assert run["generated_tokens"] == 6 * run["requests"]
            assert run["tpot_source"] == "request_log"
            assert run["aggregate_tok_s"] == level["concurrency"] * 1000 / run["tpot_ms"]["mean"]
            assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p99"]
        assert level["aggregate_tok_s"] == sum(r["aggregate_tok_s"] for r in level["runs"]) / 2  # median of two
    assert plot.read_text().startswith("<svg") and "aggregate" in plot.read_text()
    assert json.loads(capsys.readouterr().out) == report


def test_bench_agents_reports_first_turn_and_follow_up_waits(tmp_path, capsys):
    out = tmp_path / "agents.json"
    assert (
        main(
            [
                "bench",
                "agents",
                "--agents",
                "2",
                "--doc-chars",
                "1500",
                "--stagger",
                "0.1",
                "--max-tokens",
                "4",
                "--runs",
                "1",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert report["agents"] == 2 and len(run["turns"]) == 2
    assert all(len(turns) == 3 for turns in run["turns"])
    follow_ups = [t for turns in run["turns"] for t in turns if t["turn"] > 0]
    assert run["follow_up_wait_max_s"] == max(t["wait_s"] for t in follow_ups)
    assert report["median_over_runs"]["follow_up_wait_max_s"] == run["follow_up_wait_max_s"]
    assert all(t["prompt_tokens"] > 300 for t in follow_ups)  # each follow-up carries its document again


def test_bench_spec_compares_plain_and_drafters(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert (
        main(
            [
                "bench",
                "spec",
                "--drafters",
                "ngram,draft",
                "--k",
                "2",
                "--max-tokens",
                "8",
                "--runs",
                "1",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    configs = [(c["speculative"], c["draft_tokens"]) for c in report["configurations"]]
    assert configs == [("none", 0), ("ngram", 2), ("draft", 2)]
    plain, *drafted = report["configurations"]
    assert plain["speedup"] == 1.0 and plain["acceptance_length"] is None
    for config in drafted:
        assert 0 <= config["acceptance_length"] <= 2 and config["tokens_per_round"] == config["acceptance_length"] + 1
        assert len(config["acceptance_per_position"]) <= 2 and config["decode_tok_s"] > 0


def test_speculative_counters_reach_the_request_log_and_metrics(tmp_path):
    import urllib.request

    from deltaspec.bench.client import Client
    from deltaspec.bench.local_server import local_server
    from deltaspec.config import EngineConfig

    log = tmp_path / "requests.jsonl"
    with local_server(EngineConfig(device="cpu", speculative="ngram", draft_tokens=5), log) as (url, _):
        Client(url).stream(
            "completions",
            {
                "prompt": 'def is_prime(n):\n    """Return True if n is prime."""\n',
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    line = json.loads(log.read_text().splitlines()[0])
    assert line["spec_rounds"] > 0 and line["acceptance_length"] == line["spec_accepted_tokens"] / line["spec_rounds"]
    assert f"deltaspec_spec_verify_rounds_total {float(line['spec_rounds'])}" in metrics
    assert f"deltaspec_spec_accepted_tokens_total {float(line['spec_accepted_tokens'])}" in metrics
    assert 'deltaspec_spec_drafted_at_position_total{position="1"}' in metrics
