"""The serving benchmarks run end to end on the CPU and report what DESIGN §6 defines; a --url server is checked
before a benchmark starts, and every way it can fail is one error line."""

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from deltaspec.bench.client import Client, Timing
from deltaspec.bench.local_server import free_port
from deltaspec.cli import main
from deltaspec.config.engine import EngineConfig
from deltaspec.errors import DeltaspecError
from tests.server.live import serving


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

    from deltaspec.bench.local_server import local_server
    from deltaspec.config.engine import EngineConfig

    log = tmp_path / "requests.jsonl"
    with local_server(EngineConfig.from_flat(device="cpu", speculative="ngram", draft_tokens=5), log) as (url, _):
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


KEY = "bench-key"


@pytest.fixture(scope="module")
def live_url(tmp_path_factory) -> Iterator[str]:
    """The base URL (no /v1) of a live server of the embedded model on CPU, with an API key and a served name."""
    config = EngineConfig.from_flat(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=512)
    log = tmp_path_factory.mktemp("bench-url") / "requests.jsonl"
    with serving(log, config, api_key=KEY, served_model_name="tiny") as live:
        yield live.url


def bench_serve_url(url: str, *flags: str) -> list[str]:
    return ["bench", "serve", "--url", url, "--concurrency", "1", "--requests-per-client", "1", "--runs", "1", *flags]


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", ""])
def test_bench_serve_url_with_or_without_v1(live_url, suffix, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main([*bench_serve_url(live_url + suffix, "--max-tokens", "3", "--api-key", KEY, "--out", str(out))]) == 0
    report = json.loads(out.read_text())
    assert report["server"] == live_url + "/v1" and report["model"] == "tiny" and report["speculative"] == "none"
    [level] = report["levels"]
    [run] = level["runs"]
    assert run["requests"] == 1 and run["generated_tokens"] == 3 and run["tpot_source"] == "client"


def test_bench_agents_url_records_what_the_server_runs(live_url, tmp_path, capsys):
    out = tmp_path / "agents.json"
    flags = ["--agents", "1", "--doc-chars", "200", "--max-tokens", "2", "--runs", "1", "--out", str(out)]
    assert main(["bench", "agents", "--url", live_url + "/v1/", "--api-key", KEY, *flags]) == 0
    report = json.loads(out.read_text())
    assert report["server"] == live_url + "/v1" and report["model"] == "tiny" and report["max_model_len"] == 512
    assert [t["turn"] for t in report["runs"][0]["turns"][0]] == [0, 1, 2]


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1
    return captured.err


def test_bench_url_refusals_are_one_error_line(live_url, capsys):
    """Each way a --url server can turn the benchmark away is exit 2 and one sentence saying what would work."""
    cases = [
        (bench_serve_url(live_url), "pass its key with --api-key"),
        (bench_serve_url(live_url, "--api-key", "wrong"), "pass the key the server was started with"),
        (bench_serve_url(live_url + "/elsewhere/v1", "--api-key", KEY), "has no /elsewhere/v1/models (HTTP 404)"),
        (bench_serve_url(live_url, "--api-key", KEY, "--served-model-name", "big"), "serves 'tiny', not 'big'"),
        (bench_serve_url(live_url, "--api-key", KEY, "--max-tokens", "4096"), "answered POST /v1/"),
        (bench_serve_url("127.0.0.1:8000/v1"), "does not start with http:// or https://"),
        (bench_serve_url("ftp://127.0.0.1/v1"), "does not start with http:// or https://"),
        (bench_serve_url("http:///v1"), "names no host"),
        (bench_serve_url("http://127.0.0.1:99999/v1"), "is not valid"),
        (["bench", "agents", "--url", live_url + "/v1"], "pass its key with --api-key"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        assert expected in one_error_line(capsys), argv


def test_bench_serve_dead_url_exits_2_with_one_line():
    url = f"http://127.0.0.1:{free_port()}/v1"
    done = subprocess.run(
        [sys.executable, "-m", "deltaspec.cli", "bench", "serve", "--url", url], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr == f"error: Nothing answers at {url} (Connection refused); start the server first or "
        "give the address `deltaspec serve` prints, such as http://127.0.0.1:8000/v1.\n"
    )


def test_an_error_event_ends_the_benchmark_with_the_servers_message():
    event = b'data: {"error": {"message": "The server is shutting down.", "code": 503}}\n'
    with pytest.raises(DeltaspecError, match=r"ended a stream from /v1/completions with an error \(The server is "):
        Client("http://127.0.0.1:8000/v1").read_chunk(event, "completions", Timing(sent=0.0))
