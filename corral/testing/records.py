"""Sandbox records written straight to a state store, for tests of the store and of what reads it (the node
watcher, warm claims, old databases), without a create: every field a small running container's, but those
given."""

from __future__ import annotations

import dataclasses
from typing import Any

from corral.api.models import CreateSandboxRequest, SandboxState
from corral.state.records import SandboxRecord

__all__ = ["sandbox_record"]


def sandbox_record(sandbox_id: str, edge_id: str = "e0", **values: Any) -> SandboxRecord:  # noqa: ANN401
    """A running busybox container's record on ``edge_id`` (root in /, no layers, no TTL); ``values`` replace
    fields (``state="paused"``, ``labels={...}``, ...)."""
    request = CreateSandboxRequest(user="root", cwd="/")
    record = SandboxRecord.of_create(request, sandbox_id=sandbox_id, edge_id=edge_id, image="busybox",
                                     runtime="crun", layers=[], now=values.pop("created_at", 0.0))  # fmt: skip
    return dataclasses.replace(record, **{"state": SandboxState.RUNNING.value, **values})
