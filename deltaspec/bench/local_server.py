"""Run the deltaspec server in this process (uvicorn on a thread, a free loopback port) for benchmarks."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(engine_config: EngineConfig, request_log: Path):
    """Yield (base_url, engine) of a server running `engine_config`, logging requests to `request_log`."""
    import uvicorn

    from deltaspec.engine.async_engine import AsyncEngine
    from deltaspec.engine.engine import Engine
    from deltaspec.server.app import build_app

    engine = Engine(engine_config)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    server_config = ServerConfig(port=free_port(), request_log=str(request_log))
    app = build_app(async_engine, server_config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=server_config.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the benchmark server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server_config.port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        async_engine.shutdown()
