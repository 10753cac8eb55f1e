"""`bench serve` warms the server up before it measures, and refuses a rate the server did not earn: a stream that
reported no tokens, more chunks than tokens, tokens that arrived in one burst (the first `--url` run's 83,705
tok/s at C = 1), or a client TPOT the server's own /metrics contradict."""

from __future__ import annotations

import pytest

from deltaspec.bench import serve
from deltaspec.bench.client import Client, Timing
from deltaspec.bench.sanity import check_run, histogram_totals, server_tpot
from deltaspec.bench.serve import bench_serve
from deltaspec.config.engine import EngineConfig
from deltaspec.errors import DeltaspecError
from tests.server.live import serving


def streamed(tokens: int, gap_s: float, ttft_s: float = 0.05, usage: int | None = None) -> Timing:
    """A request sent at 0 whose `tokens` chunks came `gap_s` apart after `ttft_s`, with `usage` tokens reported."""
    return Timing(
        sent=0.0,
        chunk_times=[ttft_s + i * gap_s for i in range(tokens)],
        completion_tokens=tokens if usage is None else usage,
    )


CASES = [  # (timings, the server's own TPOT, what the refusal says; None: the run is sound)
    ([streamed(128, 0.02)] * 2, None, None),
    ([streamed(128, 0.02)], 0.021, None),
    ([streamed(3, 1e-6, ttft_s=2.0)], None, None),  # too short to judge: its TTFT may honestly dominate
    ([streamed(128, 0.02, usage=0)], None, "reported no generated tokens"),
    ([streamed(128, 0.02, usage=100)], None, "but the server counted 100 generated tokens"),
    ([streamed(128, 1.2e-8, ttft_s=2.6)], None, "in bursts rather than as they were generated"),
    ([streamed(128, 0.002)], 0.02, "but the server's own metrics say 20.00 ms"),
]


@pytest.mark.parametrize(("timings", "server_tpot_s", "refusal"), CASES)
def test_check_run_refuses_what_the_server_did_not_earn(timings, server_tpot_s, refusal):
    if refusal is None:
        check_run(timings, 1, server_tpot_s)
        return
    with pytest.raises(DeltaspecError, match=refusal) as caught:
        check_run(timings, 1, server_tpot_s)
    assert str(caught.value).startswith("At C=1 ") and str(caught.value).count(". ") == 0


METRICS = """# HELP vllm:time_per_output_token_seconds Time per output token.
vllm:time_per_output_token_seconds_sum{{engine="0",model_name="m"}} {sum}
vllm:time_per_output_token_seconds_count{{engine="0",model_name="m"}} {count}
deltaspec_time_per_output_token_seconds_sum {sum}
deltaspec_time_per_output_token_seconds_count {count}
"""


def test_the_servers_own_tpot_comes_from_its_metrics_between_two_scrapes():
    before, after = METRICS.format(sum=1.0, count=10), METRICS.format(sum=1.6, count=40)
    assert histogram_totals(after)["vllm:time_per_output_token_seconds"] == (1.6, 40.0)
    assert server_tpot(before, after) == pytest.approx(0.02)
    assert server_tpot(before, before) is None  # nothing was measured in between
    assert server_tpot(None, after) is None and server_tpot("up 1\n", "up 1\n") is None


def test_bench_serve_warms_up_and_then_measures_sound_runs(tmp_path):
    config = EngineConfig.from_flat(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=512)
    log = tmp_path / "requests.jsonl"
    with serving(log, config) as live:
        [row] = bench_serve(Client(live.url), [1], 2, 20, 1, progress=lambda _: None)
    [run] = row["runs"]
    assert run["requests"] == 2 and run["generated_tokens"] == 40
    records = [line for line in log.read_text().splitlines() if line]
    assert len(records) == 3  # the warm-up request, then the two measured ones


def test_bench_serve_refuses_a_burst_instead_of_reporting_it(tmp_path, monkeypatch):
    config = EngineConfig.from_flat(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=512)
    burst = [streamed(128, 1.2e-8, ttft_s=2.6)]
    monkeypatch.setattr(serve, "run_level", lambda *args: burst)
    with serving(tmp_path / "requests.jsonl", config) as live, pytest.raises(DeltaspecError, match="in bursts"):
        bench_serve(Client(live.url), [1], 1, 128, 1, progress=lambda _: None)
