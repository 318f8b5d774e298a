"""Prometheus metrics of one gateway: what the request path counts, and what the nodes report at scrape time.

Two kinds, kept apart on purpose. Events (creates, refusals, ends, pauses, audit findings, request
latencies) are counted where they happen, in this process, by prometheus-client's own counters and
histograms. Levels (sandboxes per state, memory committed and resident, PSI, pool sizes, layer cache
bytes) are read from the nodes when Prometheus scrapes, so a scrape shows the node as it is now and
nothing has to keep gauges in step with the state. Every metric of a node carries its ``edge_id``;
on a Ray cluster each gateway reports the nodes it sees, labelled the same way. Each edge also counts what
it does on its own (edge/metrics.py); a scrape asks every live edge for those samples and serves them here.

The registry belongs to the service (not prometheus-client's global one), so several servers in one
process (benchmarks, tests) keep separate counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corral.api.models import NodeStats, PoolStats
from corral.edge.metrics import CREATE_BUCKETS_S

__all__ = ["CONTENT_TYPE", "GatewayMetrics", "Levels"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Requests take from 1 ms (an exec of `true`) up.
_REQUEST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_MB = 1 << 20


@dataclass(frozen=True)
class Levels:
    """What the nodes report now, read by the scrape handler (which awaits the nodes) before rendering."""

    nodes: list[NodeStats]
    edges: list[Metric]  # each edge's own counters and histograms, edge_id-labelled (edge/metrics.py)
    pools: list[PoolStats]
    layer_cache_bytes: int
    layer_count: int


class GatewayMetrics:
    """The counters and histograms the gateway updates, and the rendering of a scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "corral_http_request_duration_seconds",
            "HTTP API requests by route template, method and status code: time until the response started.",
            ["method", "route", "code"],
            buckets=_REQUEST_BUCKETS_S,
            registry=self.registry,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.creates = Counter(
            "corral_sandbox_creates",
            "Sandbox creates by backend and outcome (created, refused: no node had room, failed).",
            ["backend", "outcome"],
            registry=self.registry,
        )
        self.create_seconds = Histogram(
            "corral_sandbox_create_duration_seconds",
            "Time from placement to a running sandbox, by backend (pulls and layer fetches excluded).",
            ["backend"],
            buckets=CREATE_BUCKETS_S,
            registry=self.registry,
        )
        self.refusals = Counter(
            "corral_admission_refusals",
            "A node refused a sandbox placed on it (the create is tried on another), by error code.",
            ["edge_id", "code"],
            registry=self.registry,
        )
        self.ended = Counter(
            "corral_sandboxes_ended", "Sandboxes that ended, by reason.", ["reason"], registry=self.registry
        )
        self.operations = Counter(
            "corral_sandbox_operations",
            "Lifecycle operations that took effect: paused, resumed, forked (one per child).",
            ["operation"],
            registry=self.registry,
        )
        for operation in ("paused", "resumed", "forked"):  # at 0 from the start: rate() sees the first one
            self.operations.labels(operation)
        self.audit = Counter(
            "corral_audit_events",
            "Audit findings by kind and severity.",
            ["kind", "severity"],
            registry=self.registry,
        )

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:  # noqa: ANN401 - the metric's own child type
        """``metric.labels(*labels)``, kept: labels() takes a lock and checks the names on every call, which the
        paths every request and every create take (request timing, created) need not pay."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_request(self, method: str, route: str, code: int, started_s: float) -> None:
        self.child(self.requests, method, route, str(code)).observe(time.perf_counter() - started_s)

    def created(self, backend: str, took_s: float) -> None:
        self.child(self.creates, backend, "created").inc()
        self.child(self.create_seconds, backend).observe(took_s)

    def render(self, levels: Levels) -> bytes:
        """One scrape: this gateway's counters, then the levels as read now."""
        scrape = CollectorRegistry()
        scrape.register(_LevelCollector(levels))
        return generate_latest(self.registry) + generate_latest(scrape)


class _LevelCollector(Collector):
    def __init__(self, levels: Levels) -> None:
        self._levels = levels

    def collect(self) -> Iterator[Metric]:
        yield from _node_families(self._levels.nodes)
        yield from _merged(self._levels.edges)
        yield from _pool_families(self._levels.pools)
        cache = GaugeMetricFamily("corral_layer_cache_bytes", "Bytes of the layer store on this gateway's disk.")
        cache.add_metric([], self._levels.layer_cache_bytes)
        layers = GaugeMetricFamily("corral_layer_cache_layers", "Layers in this gateway's layer store.")
        layers.add_metric([], self._levels.layer_count)
        yield from (cache, layers)


def _merged(families: Iterable[Metric]) -> Iterator[Metric]:
    """The edges' families joined by name: one family (one HELP and TYPE) holds every edge's samples."""
    joined: dict[str, Metric] = {}
    for family in families:
        into = joined.get(family.name)
        if into is None:
            into = joined[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        into.samples.extend(family.samples)
    yield from joined.values()


def _gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=["edge_id", *(labels or [])])


def _node_families(nodes: Iterable[NodeStats]) -> Iterator[Metric]:
    sandboxes = _gauge("corral_node_sandboxes", "Sandboxes on the node by backend and state.", ["backend", "state"])
    scalar = {
        "cpu_cores": ("corral_node_cpu_cores", "Physical cores."),
        "cpu_committed": ("corral_node_cpu_committed_cores", "CPU promised to admitted sandboxes."),
        "cpu_capacity": ("corral_node_cpu_capacity_cores", "What admission allows: cores x the CPU overcommit."),
        "load_1m": ("corral_node_load1", "Load average over one minute."),
    }
    memory = {
        "memory_total_mb": ("corral_node_memory_total_bytes", "Physical memory."),
        "memory_available_mb": ("corral_node_memory_available_bytes", "MemAvailable."),
        "memory_committed_mb": ("corral_node_memory_committed_bytes", "Memory promised to admitted sandboxes."),
        "memory_capacity_mb": ("corral_node_memory_capacity_bytes", "What admission allows: RAM x the overcommit."),
        "memory_resident_mb": ("corral_node_memory_resident_bytes", "What the sandboxes hold now."),
        "memory_reclaimed_mb": ("corral_node_memory_reclaimed_bytes", "Swap in use: mostly paused sandboxes."),
        "memory_merged_mb": ("corral_node_memory_merged_bytes", "Memory KSM saves by merging identical pages."),
        "swap_total_mb": ("corral_node_swap_total_bytes", "Swap the node has (zram for paused sandboxes)."),
    }
    scalars = {field: _gauge(name, doc) for field, (name, doc) in {**scalar, **memory}.items()}
    pressure = _gauge("corral_node_pressure_avg10_percent", "PSI avg10 in percent.", ["resource"])
    refusing = _gauge("corral_node_refusing", "1 while the node refuses new sandboxes, with the reason.", ["reason"])
    layer_cache = _gauge(
        "corral_node_layer_cache_bytes",
        "Disk taken by the layers the node fetched from the layer source (nodes with a cache of their own).",
    )
    for node in nodes:
        for backend, states in node.sandboxes.items():
            for state, count in states.items():
                sandboxes.add_metric([node.edge_id, backend, state], count)
        for field, family in scalars.items():
            value = float(getattr(node, field))
            family.add_metric([node.edge_id], value * _MB if field in memory else value)
        for resource, percent in node.pressure.items():
            pressure.add_metric([node.edge_id, resource], percent)
        refusing.add_metric([node.edge_id, node.refusing or ""], 1.0 if node.refusing else 0.0)
        if node.layer_cache_bytes is not None:
            layer_cache.add_metric([node.edge_id], node.layer_cache_bytes)
    yield sandboxes
    yield from scalars.values()
    yield from (pressure, refusing, layer_cache)


def _pool_families(pools: Iterable[PoolStats]) -> Iterator[Metric]:
    labels = ["image", "cpu", "memory_mb"]
    levels = {
        "warm": GaugeMetricFamily("corral_fncall_pool_warm", "Idle sandboxes ready for a call.", labels=labels),
        "target": GaugeMetricFamily("corral_fncall_pool_target", "How many the pool keeps warm now.", labels=labels),
        "in_use": GaugeMetricFamily("corral_fncall_pool_in_use", "Sandboxes running a call.", labels=labels),
        "waiting": GaugeMetricFamily(
            "corral_fncall_pool_waiting", "Calls waiting in line for a sandbox.", labels=labels
        ),
    }
    counts = {
        field: CounterMetricFamily(f"corral_fncall_pool_{field}", doc, labels=labels)
        for field, doc in {
            "hits": "Calls served by a warm sandbox.",
            "misses": "Calls that waited for a sandbox to start or come back.",
            "recycled": "Sandboxes reused after a call that left nothing behind.",
            "replaced": "Sandboxes thrown away after a call that changed something.",
        }.items()
    }
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {**levels, **counts}
    for pool in pools:
        key = [pool.image, f"{pool.cpu:g}", str(pool.memory_mb)]
        for field, family in families.items():
            family.add_metric(key, float(getattr(pool, field)))
    yield from levels.values()
    yield from counts.values()
