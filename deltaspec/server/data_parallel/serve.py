"""`deltaspec serve --data-parallel-size N` on one host (`serve_data_parallel`): N replica processes behind the front
door, served until interrupted or until a replica dies.

The address is bound before the replicas load, so a busy port is refused at once. Once every replica serves, the
front door prints the address (`deltaspec: serving 'NAME' at http://HOST:PORT/v1 (N data-parallel replicas)`,
after one line per replica). On SIGTERM or Ctrl-C the replicas drain as one server does (`--shutdown-timeout`)
while the front door waits for the answers in flight; a second Ctrl-C ends their requests at once. A replica that
exits while serving stops the whole server, saying so in one line (`deltaspec: data-parallel replica 1 exited
(code -9); the server stops.`), and `serve` exits with status 1; until it has stopped, requests get a 503.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from types import FrameType

import httpx2
import uvicorn
from fastapi import FastAPI

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.server.app import bind_socket
from deltaspec.server.auth import api_key_of
from deltaspec.server.data_parallel.front_door import build_front_door
from deltaspec.server.data_parallel.processes import ReplicaProcess, start_replicas, stop_replicas
from deltaspec.server.data_parallel.router import PrefixRouter
from deltaspec.server.logs import configure_logging

WATCH_POLL_S = 0.5
STOP_MARGIN_S = 15.0  # past --shutdown-timeout, how long replicas get to exit before they are killed


class FrontDoorServer(uvicorn.Server):
    """uvicorn for the front door, whose shutdown first asks every replica to drain (SIGTERM), then waits for the
    answers in flight; a second Ctrl-C passes on to the replicas, which end their requests at once."""

    def __init__(self, app: FastAPI, replicas: list[ReplicaProcess], drain_s: float) -> None:
        self.replicas = replicas
        super().__init__(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(drain_s) + 10))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            for replica in self.replicas:
                replica.signal(signal.SIGINT)
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        for replica in self.replicas:
            replica.signal(signal.SIGTERM)
        await super().shutdown(sockets)


def served_name(url: str, config: ServerConfig) -> str:
    """The model name replica `url` serves, from its /v1/models."""
    key = api_key_of(config)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.get(f"{url}/v1/models", headers=headers, trust_env=False).json()["data"][0]["id"]


def watch(replicas: list[ReplicaProcess], server: FrontDoorServer, router: PrefixRouter, failures: list[str]) -> None:
    """Stop the server, saying why, as soon as a replica exits while it serves."""
    while not server.should_exit:
        for replica in replicas:
            code = replica.process.poll()
            if code is not None and not server.should_exit:
                failures.append(
                    f"deltaspec: data-parallel replica {replica.index} exited (code {code}); the server stops."
                )
                print(failures[-1], file=sys.stderr, flush=True)
                router.up[replica.index] = False
                server.should_exit = True
        time.sleep(WATCH_POLL_S)


def run_front_door(
    sock: socket.socket, urls: list[str], server_config: ServerConfig, replicas: list[ReplicaProcess]
) -> int:
    """Serve the front door over the replicas at `urls` on `sock` until interrupted (0) or until one of the local
    `replicas` exits (1); the replicas drain as the door shuts down."""
    app = build_front_door(urls, server_config)
    server = FrontDoorServer(app, replicas, server_config.shutdown_timeout)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(
        f"deltaspec: serving '{served_name(urls[0], server_config)}' at http://{url_host}:{port}/v1 "
        f"({len(urls)} data-parallel replicas)",
        flush=True,
    )
    failures: list[str] = []
    watcher = threading.Thread(
        target=watch, args=(replicas, server, app.state.replicas.router, failures), name="deltaspec-dp-watch"
    )
    watcher.daemon = True
    watcher.start()
    server.run(sockets=[sock])
    return 1 if failures else 0


def serve_data_parallel(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve the model with `server_config.data_parallel_size` replicas on this host behind one address until
    interrupted (exit status 0) or until a replica dies (1)."""
    configure_logging()
    sock = bind_socket(server_config.host, server_config.port)
    replicas: list[ReplicaProcess] = []
    try:
        replicas = start_replicas(engine_config, server_config)
        for replica in replicas:
            print(f"deltaspec: replica {replica.index} (pid {replica.process.pid}) at {replica.url}/v1", flush=True)
        code = run_front_door(sock, [replica.url for replica in replicas], server_config, replicas)
    finally:
        stop_replicas(replicas, timeout=server_config.shutdown_timeout + STOP_MARGIN_S)
        sock.close()
    print("deltaspec: shut down", flush=True)
    return code
