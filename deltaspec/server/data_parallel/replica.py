"""The program of one data-parallel replica that `deltaspec serve --data-parallel-size N` starts
(`processes.start_replicas`): `python -m deltaspec.server.data_parallel.replica` reads its arguments, pickled, from
standard input and runs the ordinary server (`run_server`), which prints the address it serves at on standard
output. Its log records name the replica (`deltaspec.server[1]: ...`). When the process that started it is gone,
it drains and exits as on SIGTERM. Its own module, so the process never imports the starting program's `__main__`.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.errors import DeltaspecError
from deltaspec.server.app import run_server
from deltaspec.server.logs import DATE_FORMAT, LOG_FORMAT

PARENT_POLL_S = 0.5


def log_as_replica(index: int) -> None:
    """deltaspec's INFO records to stderr, each naming replica `index`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT.replace("%(name)s", f"%(name)s[{index}]"), DATE_FORMAT))
    root = logging.getLogger("deltaspec")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def stop_when_orphaned(parent: int) -> None:
    """Once `parent` is no longer this process's parent, send this process SIGTERM (the server drains and exits),
    its standard output, which nobody reads any more, sent to /dev/null."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    os.kill(os.getpid(), signal.SIGTERM)


def run_replica(engine_config: EngineConfig, server_config: ServerConfig, index: int, parent: int) -> int:
    log_as_replica(index)
    threading.Thread(target=stop_when_orphaned, args=(parent,), name="deltaspec-parent-watch", daemon=True).start()
    try:
        run_server(engine_config, server_config)
    except DeltaspecError as exc:
        print(f"error: replica {index}: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_replica(*pickle.load(sys.stdin.buffer)))
