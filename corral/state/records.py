"""A sandbox's record: what the state store keeps of it, typed, and the conversions it owns.

One place spells a sandbox's settings out: a create request becomes a record (``of_create``), a record becomes
the spec its edge starts or re-adopts (``to_spec``), the request that makes another sandbox like it for forks
and replays (``to_request``) and what a client reads (``to_info``). The fields are the ``sandboxes`` table's
columns in its order, less ``job`` (``labels["job"]`` copied out for its index, written by ``row``);
tests/unit/test_sandbox_record.py holds the two to each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from corral.api.models import CreateSandboxRequest, NetworkPolicy, SandboxInfo, SandboxState
from corral.backends.base import WARM_LABEL, LayerRef, SandboxSpec, setuid_allowed
from corral.backends.common.network import to_allow_rules

__all__ = ["JOB_LABEL", "SandboxRecord"]

JOB_LABEL = "job"


@dataclass(slots=True)
class SandboxRecord:
    """One row of the ``sandboxes`` table. A snapshot: a change goes through the store, then is read again.
    Not frozen: a frozen dataclass sets each of its 28 fields through ``object.__setattr__``, which doubled the
    record's cost on the create path (~7 vs ~15 us a record)."""

    id: str
    edge_id: str
    state: str  # a SandboxState value
    image: str  # the listed image name
    backend: str
    runtime: str
    cpu: float
    qos: str
    memory_mb: int
    pids_max: int
    user: str
    cwd: str
    env: dict[str, str]
    layers: list[str]  # mount keys (digest, or digest#alias), bottom first
    labels: dict[str, str]
    node_selector: dict[str, str]
    created_at: float
    expires_at: float | None
    ttl_counts_paused: bool
    idle_pause_s: float | None
    paused_at: float | None
    network: dict[str, Any] | None  # a NetworkPolicy as JSON; None: loopback only
    protected_paths: list[str] | None  # None in records older than the column
    sensitive_paths: list[str] | None
    disk_mb: int | None
    ended_at: float | None
    end_reason: str | None
    status_message: str | None

    @classmethod
    def of_create(
        cls, request: CreateSandboxRequest, *, sandbox_id: str, edge_id: str, image: str, runtime: str,
        layers: Sequence[str], now: float,
    ) -> SandboxRecord:  # fmt: skip
        """A prepared create's record (``cwd`` and ``user`` filled in from the image), creating."""
        assert request.cwd is not None and request.user is not None  # the service's _prepare fills them in
        return cls(
            id=sandbox_id, edge_id=edge_id, state=SandboxState.CREATING.value, image=image, backend=request.backend,
            runtime=runtime, cpu=request.cpu, qos=request.qos, memory_mb=request.memory_mb,
            pids_max=request.pids_max, user=request.user, cwd=request.cwd, env=request.env, layers=list(layers),
            labels=request.labels, node_selector=request.node_selector, created_at=now,
            expires_at=now + request.ttl_s if request.ttl_s else None, ttl_counts_paused=request.ttl_counts_paused,
            idle_pause_s=request.idle_pause_s, paused_at=None,
            network=request.network.model_dump() if request.network is not None else None,
            protected_paths=request.protected_paths, sensitive_paths=request.sensitive_paths,
            disk_mb=request.disk_mb, ended_at=None, end_reason=None, status_message=None,
        )  # fmt: skip

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return _FIELDS

    @property
    def job(self) -> str | None:
        return self.labels.get(JOB_LABEL)

    def row(self) -> dict[str, Any]:
        """The table row: every field, and ``job``."""
        return {name: getattr(self, name) for name in _FIELDS} | {"job": self.labels.get(JOB_LABEL)}

    def to_spec(self, layers: tuple[LayerRef, ...], *, restore_from: str | None = None) -> SandboxSpec:
        """What its edge starts, or takes back after a restart (``layers``: its stack's files on that node)."""
        allow = None if self.network is None else to_allow_rules(NetworkPolicy.model_validate(self.network).allow)
        return SandboxSpec(
            sandbox_id=self.id, image=self.image, layers=layers, runtime=self.runtime, cpu=self.cpu,
            memory_mb=self.memory_mb, pids_max=self.pids_max, qos=self.qos, env=self.env, cwd=self.cwd,
            user=self.user, idle_pause_s=self.idle_pause_s, network=allow,
            protected_paths=tuple(self.protected_paths or ()), sensitive_paths=tuple(self.sensitive_paths or ()),
            disk_mb=self.disk_mb, backend=self.backend, restore_from=restore_from,
            setuid_allowed=setuid_allowed(self.labels), pool_member=WARM_LABEL in self.labels,
        )  # fmt: skip

    def to_request(self, *, labels: dict[str, str], **overrides: Any) -> CreateSandboxRequest:  # noqa: ANN401
        """A create with this sandbox's settings (stack, backend, limits, env, user, TTL length, guard, node
        selector), for its forks and replays; ``labels`` are added to its own, ``overrides`` replace fields."""
        values: dict[str, Any] = {
            "layers": self.layers, "backend": self.backend, "runtime": self.runtime, "cpu": self.cpu,
            "qos": self.qos, "memory_mb": self.memory_mb, "pids_max": self.pids_max, "env": self.env,
            "cwd": self.cwd, "user": self.user,
            "ttl_s": self.expires_at - self.created_at if self.expires_at else None,
            "ttl_counts_paused": self.ttl_counts_paused, "idle_pause_s": self.idle_pause_s,
            "protected_paths": self.protected_paths or [], "sensitive_paths": self.sensitive_paths or [],
            "disk_mb": self.disk_mb, "labels": {**self.labels, **labels}, "node_selector": self.node_selector,
        }  # fmt: skip
        return CreateSandboxRequest(**{**values, **overrides})

    def to_info(self, **changes: Any) -> SandboxInfo:  # noqa: ANN401 - SandboxInfo's fields
        """What a client reads of it; ``changes``: fields the store was just told otherwise (a create's state once
        it runs), without a copy of the record."""
        return SandboxInfo(**{name: getattr(self, name) for name in _INFO_FIELDS} | changes)


_FIELDS = tuple(field.name for field in dataclasses.fields(SandboxRecord))
_INFO_FIELDS = tuple(name for name in SandboxInfo.model_fields if name in _FIELDS)
