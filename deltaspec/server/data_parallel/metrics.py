"""The front door's `/metrics`: the router's own numbers per replica, then every replica's own metrics with a
`replica` label added, so one scrape shows each replica's load and the sums over replicas still add up (a
histogram's `_sum` and `_count` over all label sets are the whole server's).

Router metrics, read from the `PrefixRouter` at scrape time: `deltaspec_router_requests_in_flight` (requests sent to
the replica and not yet answered), `deltaspec_router_requests` (requests routed, by `route`: `prefix` for a prefix
hit, `load` for the least-loaded replica, `balance` for the least-loaded one when the load was out of balance),
`deltaspec_router_replica_up` (1 while the replica answers) and `deltaspec_router_prefix_index_blocks` (the size of
the router's record of the replica's prompts).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from deltaspec.server.data_parallel.router import ROUTES, PrefixRouter


class RouterCollector(Collector):
    """The router's numbers per replica (see the module docstring)."""

    def __init__(self, router: PrefixRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router, replicas = self.router, range(len(self.router.up))
        in_flight = GaugeMetricFamily(
            "deltaspec_router_requests_in_flight",
            "Requests sent to the replica and not yet answered.",
            labels=["replica"],
        )
        routed = CounterMetricFamily(
            "deltaspec_router_requests", "Requests routed to the replica, by why.", labels=["replica", "route"]
        )
        up = GaugeMetricFamily("deltaspec_router_replica_up", "1 while the replica answers.", labels=["replica"])
        index = GaugeMetricFamily(
            "deltaspec_router_prefix_index_blocks",
            "Prompt blocks in the router's record of the prompts routed to the replica.",
            labels=["replica"],
        )
        for i in replicas:
            label = str(i)
            in_flight.add_metric([label], router.in_flight[i])
            up.add_metric([label], 1.0 if router.up[i] else 0.0)
            index.add_metric([label], len(router.indexes[i]))
            for reason in ROUTES:
                routed.add_metric([label, reason], router.routed[i, reason])
        yield from (in_flight, routed, up, index)


class FamiliesCollector(Collector):
    """Metric families already gathered."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def labelled_families(expositions: dict[int, str]) -> list[Metric]:
    """The replicas' metric families (replica index -> its /metrics text), each sample labelled with its replica,
    one family per name with every replica's samples."""
    merged: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            target.samples += [
                sample._replace(labels={"replica": str(replica), **sample.labels}) for sample in family.samples
            ]
    return list(merged.values())


def render(router: PrefixRouter, expositions: dict[int, str]) -> bytes:
    """The front door's /metrics body: the router's metrics, then the replicas' labelled ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    registry.register(FamiliesCollector(labelled_families(expositions)))
    return generate_latest(registry)
