"""Prometheus counters and histograms of one edge: what its node did on its own, counted where it happened.

A gateway counts what passes through it (gateway/metrics.py). What an edge does by itself (an idle pause, a
resume when a request reaches a paused sandbox, a sandbox whose init exited, an audit finding of its
housekeeping) and how long its node takes to start a sandbox are counted here, in the edge's own registry,
every sample labelled with its ``edge_id``. On a Ray cluster that registry lives in the node's edge actor,
where no gateway sees those events happen; a gateway's scrape asks each live edge for its samples, one call
per edge beside its stats (``Edge.metric_families``), and serves them with its own. That keeps one scrape
target per gateway, behind the API key it already has, rather than a port per node to open, secure and list.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric

from corral.edge.protocol import EdgeEvents

__all__ = ["CREATE_BUCKETS_S", "CountedEvents", "EdgeMetrics"]

CREATE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Sandbox starts take 10 ms (a warm container) to a minute (a cold VM image)."""


class EdgeMetrics:
    """One edge's counters and histogram, in a registry of its own (several edges share a process in benches)."""

    def __init__(self, edge_id: str) -> None:
        self.edge_id = edge_id
        self.registry = CollectorRegistry()
        self.ended = Counter(
            "corral_edge_sandboxes_ended",
            "Sandboxes the node saw end on their own (their init exited), by reason.",
            ["edge_id", "reason"],
            registry=self.registry,
        )
        self.operations = Counter(
            "corral_edge_sandbox_operations",
            "What the node did on its own: paused (idle, memory pressure), resumed (a request reached it paused).",
            ["edge_id", "operation"],
            registry=self.registry,
        )
        for operation in ("paused", "resumed"):  # at 0 from the start: every edge is listed, rate() sees the first
            self.operations.labels(edge_id, operation)
        self.audit = Counter(
            "corral_edge_audit_events",
            "Audit findings of the node's own housekeeping (kernel-reported, denied packets), by kind and severity.",
            ["edge_id", "kind", "severity"],
            registry=self.registry,
        )
        self.start_seconds = Histogram(
            "corral_edge_sandbox_start_duration_seconds",
            "Time the node took to admit and start a sandbox (its layers on the node already), by backend.",
            ["edge_id", "backend"],
            buckets=CREATE_BUCKETS_S,
            registry=self.registry,
        )

        self.step_files = Counter(
            "corral_edge_step_files_lookups",
            "Steps whose changed files the node looked up for the trajectory log, by how: journal (a container's "
            "change journal), walk (its writable layer walked: slow in a large layer), guest (a walk in a microvm), "
            "none (a full VM: not looked up).",
            ["edge_id", "how"],
            registry=self.registry,
        )
        self.gateway_calls = Counter(
            "corral_edge_gateway_calls",
            "Calls a cluster's gateways made to the node's edge actor, by path: channel (the connection a gateway "
            "keeps to the actor, the hot path's) or ray (an actor call: large transfers, and every call where the "
            "channel is off or cannot be reached).",
            ["edge_id", "via"],
            registry=self.registry,
        )
        self._started: dict[str, Any] = {}  # backend -> its histogram child (labels() locks and checks each call)
        self._step_files: dict[str, Any] = {}  # how -> its counter child
        self._gateway_calls: dict[str, Any] = {}  # via -> its counter child

    def started(self, backend: str, took_s: float) -> None:
        child = self._started.get(backend)
        if child is None:
            child = self._started[backend] = self.start_seconds.labels(self.edge_id, backend)
        child.observe(took_s)

    def found_step_files(self, how: str) -> None:
        child = self._step_files.get(how)
        if child is None:
            child = self._step_files[how] = self.step_files.labels(self.edge_id, how)
        child.inc()

    def gateway_call(self, via: str) -> None:
        child = self._gateway_calls.get(via)
        if child is None:
            child = self._gateway_calls[via] = self.gateway_calls.labels(self.edge_id, via)
        child.inc()

    def families(self) -> list[Metric]:
        """The samples now, as plain objects (they cross to a gateway as Ray objects)."""
        return list(self.registry.collect())


class CountedEvents:
    """``EdgeEvents`` that counts each report in the edge's metrics, then passes it on."""

    def __init__(self, events: EdgeEvents, metrics: EdgeMetrics) -> None:
        self._events = events
        self._metrics = metrics

    def ended(self, sandbox_id: str, reason: str, message: str) -> None:
        self._metrics.ended.labels(self._metrics.edge_id, reason).inc()
        self._events.ended(sandbox_id, reason, message)

    def paused(self, sandbox_id: str, at: float) -> None:
        self._metrics.operations.labels(self._metrics.edge_id, "paused").inc()
        self._events.paused(sandbox_id, at)

    def resumed(self, sandbox_id: str, at: float) -> None:
        self._metrics.operations.labels(self._metrics.edge_id, "resumed").inc()
        self._events.resumed(sandbox_id, at)

    def audit(self, sandbox_id: str, kind: str, severity: str, detail: dict[str, Any]) -> None:
        self._metrics.audit.labels(self._metrics.edge_id, kind, severity).inc()
        self._events.audit(sandbox_id, kind, severity, detail)
