"""`deltaspec bench data-parallel`: what N data-parallel replicas add over one. The goal (issue #51) is that N
replicas serve N times one replica's requests at the same latency: at N x C concurrent clients, N times the aggregate
rate of one replica at C, with the same TPOT and TTFT.

One replica behind the front door at C clients, then N replicas behind it at N x C, each level measured as
`bench serve` measures it (one warm-up request, medians of `runs`, TPOT from the replicas' request log, the same
sanity checks), and the ratios: aggregate rate (N is the goal), p50 TPOT and p50 TTFT (1 is the goal). Both layouts
are `deltaspec serve --data-parallel-size`'s replica processes and front door, started in this process
(`front_door_over`), so the door's cost is in both. On the CPU the replicas share the host's cores (each takes its
share unless --threads says), so only replicas on GPUs of their own can show the N.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from deltaspec.bench.client import Client
from deltaspec.bench.serve import bench_serve
from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.server.app import bind_socket
from deltaspec.server.data_parallel.front_door import build_front_door
from deltaspec.server.data_parallel.processes import start_replicas, stop_replicas

STOP_S = 60.0


@contextmanager
def front_door_over(engine_config: EngineConfig, replicas: int, request_log: Path) -> Iterator[str]:
    """The base URL of a front door (on a thread, a free loopback port) over `replicas` replica processes that log
    their requests to `request_log`."""
    server_config = ServerConfig(request_log=str(request_log), data_parallel_size=replicas, disable_log_stats=True)
    processes = start_replicas(engine_config, server_config)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(
        uvicorn.Config(build_front_door([p.url for p in processes], server_config), log_level="warning")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    try:
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the benchmark's front door did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_S)
        sock.close()
        stop_replicas(processes, timeout=STOP_S)


def bench_data_parallel(
    engine_config: EngineConfig,
    replicas: int,
    concurrency: int,
    per_client: int,
    max_tokens: int,
    runs: int,
    progress: Callable[[str], None] = print,
) -> dict:
    """One replica at `concurrency` clients and `replicas` replicas at `replicas` x `concurrency` (see the module
    docstring)."""
    levels = {}
    for count in (1, replicas):
        level = count * concurrency
        progress(f"{count} replica(s) at C={level}")
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "requests.jsonl"
            with front_door_over(engine_config, count, log) as url:
                levels[count] = bench_serve(Client(url), [level], per_client, max_tokens, runs, log, progress)[0]
    one, many = levels[1], levels[replicas]
    return {
        "one_replica": one,
        "replicas": many,
        "aggregate_ratio": many["aggregate_tok_s"] / one["aggregate_tok_s"],
        "tpot_p50_ratio": many["tpot_p50_ms"] / one["tpot_p50_ms"],
        "ttft_p50_ratio": many["ttft_p50_s"] / one["ttft_p50_s"],
    }
