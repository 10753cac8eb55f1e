"""`deltaspec serve --data-parallel-size N --data-parallel-backend ray` (`serve_on_ray`): the replicas as Ray Serve
deployments on the hosts of a Ray cluster, the front door in this process.

One Serve application, `deltaspec`, holds N deployments of one Serve replica each (`RayReplica`, named
`replica-0` ...), each given `--tensor-parallel-size` GPUs (none with `--device cpu`) wherever the cluster has room.
A `RayReplica` runs the ordinary server as its child process (`processes.start_replica`), on its node's address at
port `--port` + 1 + its index (a free port with `--port 0`), so the front door, the same one as on one host
(`serve.run_front_door`), reaches it there, again after Ray restarts it when its health check fails (the server
process ended). The application's ingress, `ReplicaDirectory`, only tells the front door where the replicas are;
Ray's own HTTP proxy is not started. Leaving `serve` deletes the application, and each replica drains as it goes.

Ray is an optional extra (`pip install 'deltaspec[ray]'`); only `serve_on_ray` imports it. This module is glue
between the tested front door and the tested server, and was not run in deltaspec's tests (Ray was not installed).
"""

from __future__ import annotations

import os
from dataclasses import replace

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.errors import DeltaspecError
from deltaspec.server.app import bind_socket
from deltaspec.server.data_parallel.processes import (
    replica_server_config,
    start_replica,
    stop_replicas,
    wait_until_serving,
)
from deltaspec.server.data_parallel.serve import STOP_MARGIN_S, run_front_door
from deltaspec.server.logs import configure_logging

APPLICATION = "deltaspec"
HEALTH_CHECK_S = 10.0


class RayReplica:
    """One replica as a Ray Serve deployment: the ordinary server in a child process on this node's address."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, index: int, port: int) -> None:
        import ray

        self.drain_s = server_config.shutdown_timeout + STOP_MARGIN_S
        config = replace(server_config, host=ray.util.get_node_ip_address(), port=port)
        self.replica = start_replica(index, engine_config, config, dict(os.environ))
        wait_until_serving([self.replica])

    def url(self) -> str:
        return self.replica.url

    def check_health(self) -> None:
        """Ray Serve's health check: the server process still runs (else Ray replaces this replica)."""
        code = self.replica.process.poll()
        if code is not None:
            raise RuntimeError(f"deltaspec replica {self.replica.index} exited (code {code})")

    def __del__(self) -> None:
        stop_replicas([self.replica], timeout=self.drain_s)


class RayReplicaDirectory:
    """The application's ingress: where each replica serves."""

    def __init__(self, *replicas) -> None:
        self.replicas = replicas

    async def urls(self) -> list[str]:
        return [await replica.url.remote() for replica in self.replicas]


def serve_on_ray(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve the model with `server_config.data_parallel_size` replicas on the Ray cluster (`ray.init()`: the one
    RAY_ADDRESS names or this host's, else a new local one) until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise DeltaspecError(
            "--data-parallel-backend ray needs Ray Serve, which is not installed; install it with "
            "pip install 'deltaspec[ray]'."
        ) from None
    configure_logging()
    sock = bind_socket(server_config.host, server_config.port)
    count, base = server_config.data_parallel_size, server_config.port
    gpus = 0 if engine_config.host.device == "cpu" else engine_config.parallel.world_size
    try:
        ray.init()
        serve.start(proxy_location="Disabled")
        replica = serve.deployment(
            RayReplica, ray_actor_options={"num_gpus": gpus}, health_check_period_s=HEALTH_CHECK_S
        )
        config = replica_server_config(server_config)
        replicas = [
            replica.options(name=f"replica-{i}").bind(engine_config, config, i, base + 1 + i if base else 0)
            for i in range(count)
        ]
        directory = serve.run(
            serve.deployment(RayReplicaDirectory).bind(*replicas), name=APPLICATION, route_prefix=None
        )
        urls = directory.urls.remote().result()
        for i, url in enumerate(urls):
            print(f"deltaspec: replica {i} at {url}/v1", flush=True)
        code = run_front_door(sock, urls, server_config, [])
    finally:
        if ray.is_initialized():
            serve.delete(APPLICATION)
        sock.close()
    print("deltaspec: shut down", flush=True)
    return code
