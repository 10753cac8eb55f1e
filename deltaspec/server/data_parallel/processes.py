"""The replica processes of `deltaspec serve --data-parallel-size N`: what each is given (`replica_environments`,
`replica_server_config`), starting them and learning their addresses (`start_replicas` on this host; `start_replica`
and `wait_until_serving` one at a time, as Ray's deployments do), and stopping them (`ReplicaProcess.signal`,
`stop_replicas`).

Each replica is the ordinary server (`replica.py`) on a free loopback port, in a session of its own, so a Ctrl-C
at the terminal reaches only `serve`, which then asks each replica to drain. On CUDA each replica sees its own
`--tensor-parallel-size` GPUs (`CUDA_VISIBLE_DEVICES`, a slice of those this process sees); on the CPU the replicas
share the host and split its cores, unless `--threads` says how many each takes.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from deltaspec.config.engine import EngineConfig
from deltaspec.config.host import default_threads
from deltaspec.config.server import ServerConfig
from deltaspec.errors import DeltaspecError

SERVING = re.compile(r"^deltaspec: serving '.*' at (http://\S+)/v1$")
STARTING_POLL_S = 0.1
STOP_STARTING_S = 10.0  # how long the other replicas get to exit when one failed to start


@dataclass
class ReplicaProcess:
    """One replica's process and, once it serves, its base URL; its standard output is read on a thread of its own
    (the serving line sets `url`; other lines go to stderr, naming the replica)."""

    index: int
    process: subprocess.Popen
    url: str | None = None
    done_starting: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read_output, name=f"deltaspec-replica-{self.index}", daemon=True).start()

    def _read_output(self) -> None:
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            match = SERVING.match(line)
            if self.url is None and match:
                self.url = match.group(1)
                self.done_starting.set()
            elif line != "deltaspec: shut down":
                print(f"replica {self.index}: {line}", file=sys.stderr, flush=True)
        self.done_starting.set()  # the process closed its output: it ended, serving or not

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)


def replica_environments(engine_config: EngineConfig, replicas: int) -> list[dict[str, str]]:
    """The environment of each replica: on CUDA, its `--tensor-parallel-size` GPUs of those this process sees."""
    device = engine_config.host.device_name()
    if not device.startswith("cuda"):
        return [dict(os.environ) for _ in range(replicas)]
    if device != "cuda":
        raise DeltaspecError(
            f"--device {device} names one GPU, but --data-parallel-size {replicas} gives each replica GPUs of its own; "
            "give --device cuda (or leave it out) and set CUDA_VISIBLE_DEVICES to choose the GPUs."
        )
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    per_replica = engine_config.parallel.world_size  # pipeline stages x tensor-parallel ranks
    if replicas * per_replica > len(gpus):
        raise DeltaspecError(
            f"--data-parallel-size {replicas} x {per_replica} GPUs per replica (tensor x pipeline parallel) needs "
            f"{replicas * per_replica} GPUs, but this process sees {len(gpus)}; give fewer replicas or smaller "
            "parallel sizes."
        )
    return [
        {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per_replica : (i + 1) * per_replica])}
        for i in range(replicas)
    ]


def replica_server_config(server_config: ServerConfig) -> ServerConfig:
    """A replica's server: on a free loopback port, one replica, its browser rules and access log left to the front
    door."""
    return replace(
        server_config,
        host="127.0.0.1",
        port=0,
        data_parallel_size=1,
        data_parallel_backend="mp",
        allowed_hosts=None,
        allowed_origins=None,
        access_log=False,
    )


def start_replica(
    index: int, engine_config: EngineConfig, server_config: ServerConfig, environment: dict[str, str]
) -> ReplicaProcess:
    """Start replica `index` (`replica.py`) with this process's import path, in a session of its own."""
    process = subprocess.Popen(
        [sys.executable, "-m", "deltaspec.server.data_parallel.replica"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**environment, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        start_new_session=True,
    )
    pickle.dump((engine_config, server_config, index, os.getpid()), process.stdin)
    process.stdin.close()
    return ReplicaProcess(index, process)


def wait_until_serving(replicas: list[ReplicaProcess]) -> None:
    """Return once every replica serves; when one stops before it does, stop the others and raise."""
    while True:
        failed = next((r for r in replicas if r.done_starting.is_set() and r.url is None), None)
        if failed is not None:
            stop_replicas(replicas, timeout=STOP_STARTING_S)
            raise DeltaspecError(
                f"Data-parallel replica {failed.index} stopped before serving (exit code {failed.process.wait()}); "
                "its error is above."
            )
        if all(r.done_starting.is_set() for r in replicas):
            return
        time.sleep(STARTING_POLL_S)


def start_replicas(engine_config: EngineConfig, server_config: ServerConfig) -> list[ReplicaProcess]:
    """Start `server_config.data_parallel_size` replicas on this host and return them once every one serves. On the
    CPU, without --threads, each takes its share of the cores."""
    count = server_config.data_parallel_size
    environments = replica_environments(engine_config, count)
    if engine_config.host.threads is None and not engine_config.host.device_name().startswith("cuda"):
        engine_config = engine_config.with_settings(threads=max(1, default_threads() // count))
    config = replica_server_config(server_config)
    replicas = [start_replica(i, engine_config, config, environment) for i, environment in enumerate(environments)]
    wait_until_serving(replicas)
    return replicas


def stop_replicas(replicas: list[ReplicaProcess], timeout: float) -> None:
    """Ask every replica to drain and exit (SIGTERM), wait up to `timeout` seconds in all, then kill the rest."""
    for replica in replicas:
        replica.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for replica in replicas:
        try:
            replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()
