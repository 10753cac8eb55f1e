"""`deltaspec bench serve`: C concurrent clients, each sending requests back to back.

For each concurrency C the report gives TTFT and TPOT percentiles and the aggregate decode rate
`C x 1000 / mean TPOT (ms)` (DESIGN §6), with TPOT taken from the server's request log when the
server runs in-process and from the client's token timings otherwise (`tpot_source`). One warm-up request,
not measured, runs first (a server's first request pays for its lazy set-up: compiling, allocating, caching).
Each level runs `runs` times; the level's headline numbers are the medians over runs, and every run is kept.
A run that the server's own counts or times contradict is refused (`sanity.py`).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deltaspec.bench.client import Client, Timing
from deltaspec.bench.prompts import requests
from deltaspec.bench.sanity import check_run, server_tpot
from deltaspec.bench.stats import percentiles

WARM_UP_TOKENS = 16


def body_of(base: dict, max_tokens: int) -> dict:
    """A benchmark request: `max_tokens` tokens, greedy, whatever the model would rather end with."""
    return {**base, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def warm_up(client: Client, max_tokens: int) -> None:
    """One request that is not measured, as long as a measured one or shorter."""
    endpoint, base = requests(1)[0]
    client.stream(endpoint, body_of(base, min(max_tokens, WARM_UP_TOKENS)))


def run_level(client: Client, concurrency: int, per_client: int, max_tokens: int) -> list[Timing]:
    work = requests(concurrency * per_client)

    def worker(k: int) -> list[Timing]:
        return [client.stream(endpoint, body_of(body, max_tokens)) for endpoint, body in work[k::concurrency]]

    with ThreadPoolExecutor(concurrency) as pool:
        return [t for timings in pool.map(worker, range(concurrency)) for t in timings]


def log_tpots(request_log: Path | None, since_line: int) -> tuple[list[float], int]:
    """TPOTs (seconds) of the requests logged after line `since_line`, and the new line count."""
    if request_log is None or not request_log.exists():
        return [], since_line
    lines = request_log.read_text().splitlines()
    tpots = [json.loads(line).get("tpot_s") for line in lines[since_line:]]
    return [t for t in tpots if t], len(lines)


def measure_level(
    client: Client, concurrency: int, per_client: int, max_tokens: int, request_log: Path | None, logged: int
) -> tuple[dict, int]:
    """One run of one concurrency level, and the request-log line count after it; a run the server's own counts or
    times contradict is a DeltaspecError."""
    scraped = client.metrics()
    start = time.perf_counter()
    timings = run_level(client, concurrency, per_client, max_tokens)
    wall = time.perf_counter() - start
    check_run(timings, concurrency, server_tpot(scraped, client.metrics()))
    server_tpots, logged = log_tpots(request_log, logged)
    tpots = server_tpots or [t.tpot for t in timings if t.tpot]
    ttft = percentiles([t.ttft for t in timings if t.ttft is not None])
    tpot = percentiles([x * 1000 for x in tpots])
    generated = sum(t.completion_tokens for t in timings)
    return {
        "requests": len(timings),
        "generated_tokens": generated,
        "wall_s": wall,
        "ttft_s": ttft,
        "tpot_ms": tpot,
        "tpot_source": "request_log" if server_tpots else "client",
        "aggregate_tok_s": concurrency * 1000 / tpot["mean"] if tpot["mean"] else None,
        "output_tok_s_wall": generated / wall,
    }, logged


def bench_serve(
    client: Client,
    levels: list[int],
    per_client: int,
    max_tokens: int,
    runs: int,
    request_log: Path | None = None,
    progress=print,
) -> list[dict]:
    warm_up(client, max_tokens)
    results, logged = [], log_tpots(request_log, 0)[1]
    for concurrency in levels:
        measured = []
        for _ in range(runs):
            run, logged = measure_level(client, concurrency, per_client, max_tokens, request_log, logged)
            measured.append(run)
        row = {
            "concurrency": concurrency,
            "runs": measured,
            **{
                key: statistics.median(r[key] for r in measured if r[key] is not None)
                for key in ("aggregate_tok_s", "output_tok_s_wall")
            },
            "ttft_p50_s": statistics.median(r["ttft_s"]["p50"] for r in measured),
            "tpot_p50_ms": statistics.median(r["tpot_ms"]["p50"] for r in measured),
        }
        progress(
            f"C={concurrency}: aggregate {row['aggregate_tok_s']:.1f} tok/s (median of {runs}), "
            f"TTFT p50 {row['ttft_p50_s']:.3f} s, TPOT p50 {row['tpot_p50_ms']:.1f} ms"
        )
        results.append(row)
    return results
