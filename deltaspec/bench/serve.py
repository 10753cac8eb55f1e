"""`deltaspec bench serve`: C concurrent clients, each sending requests back to back.

For each concurrency C the report gives TTFT and TPOT percentiles and the aggregate decode rate
`C x 1000 / mean TPOT (ms)` (DESIGN §6), with TPOT taken from the server's request log when the
server runs in-process and from the client's token timings otherwise (`tpot_source`).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deltaspec.bench.client import Client, Timing
from deltaspec.bench.prompts import requests
from deltaspec.bench.stats import percentiles


def run_level(client: Client, concurrency: int, per_client: int, max_tokens: int) -> list[Timing]:
    work = requests(concurrency * per_client)

    def worker(k: int) -> list[Timing]:
        return [client.stream(endpoint, {**body, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
                for endpoint, body in work[k::concurrency]]

    with ThreadPoolExecutor(concurrency) as pool:
        return [t for timings in pool.map(worker, range(concurrency)) for t in timings]


def log_tpots(request_log: Path | None, since_line: int) -> tuple[list[float], int]:
    """TPOTs (seconds) of the requests logged after line `since_line`, and the new line count."""
    if request_log is None or not request_log.exists():
        return [], since_line
    lines = request_log.read_text().splitlines()
    tpots = [json.loads(line).get("tpot_s") for line in lines[since_line:]]
    return [t for t in tpots if t], len(lines)


def bench_serve(client: Client, levels: list[int], per_client: int, max_tokens: int,
                request_log: Path | None = None, progress=print) -> list[dict]:
    results, logged = [], log_tpots(request_log, 0)[1]
    for concurrency in levels:
        start = time.perf_counter()
        timings = run_level(client, concurrency, per_client, max_tokens)
        wall = time.perf_counter() - start
        server_tpots, logged = log_tpots(request_log, logged)
        tpots = server_tpots or [t.tpot for t in timings if t.tpot]
        ttft = percentiles([t.ttft for t in timings if t.ttft is not None])
        tpot = percentiles([x * 1000 for x in tpots])
        generated = sum(t.completion_tokens for t in timings)
        row = {"concurrency": concurrency, "requests": len(timings), "generated_tokens": generated,
               "wall_s": wall, "ttft_s": ttft, "tpot_ms": tpot, "tpot_source": "request_log" if server_tpots else "client",
               "aggregate_tok_s": concurrency * 1000 / tpot["mean"] if tpot["mean"] else None,
               "output_tok_s_wall": generated / wall}
        progress(f"C={concurrency}: aggregate {row['aggregate_tok_s'] or 0:.1f} tok/s, "
                 f"TTFT p50 {ttft['p50'] or 0:.3f} s, TPOT p50 {tpot['p50'] or 0:.1f} ms")
        results.append(row)
    return results
