"""Reading the event stream: what happened to sandboxes and nodes, in id order, from any id on.

The rows are written by the state store and the audit log in the transaction of the change they
report (corral/state/db.py, ``events``), by every gateway and every edge actor of a cluster alike, so
one query answers "what happened after event N" for the whole cluster. Followers poll: a query by
primary key every quarter second is cheaper than keeping every writer's process able to wake them.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine

from corral.state.db import events, sandboxes
from corral.state.records import JOB_LABEL

__all__ = ["EventFilter", "EventLog"]


class EventFilter:
    """Which events a reader wants; a job token's reader sees only its job's sandboxes."""

    def __init__(
        self,
        *,
        sandbox_id: str | None = None,
        kinds: list[str] | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.kinds = kinds or []
        self.labels = dict(labels or {})
        if job is not None:
            self.labels[JOB_LABEL] = job


class EventLog:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def read(self, after_id: int, wanted: EventFilter, limit: int = 1000) -> list[dict[str, Any]]:
        """Events after ``after_id`` that ``wanted`` matches, oldest first, at most ``limit``."""
        query = select(events).where(events.c.id > after_id).order_by(events.c.id).limit(limit)
        if wanted.sandbox_id is not None:
            query = query.where(events.c.sandbox_id == wanted.sandbox_id)
        if wanted.kinds:
            query = query.where(events.c.kind.in_(wanted.kinds))
        labels = dict(wanted.labels)
        job = labels.pop(JOB_LABEL, None)
        if job is not None:  # copied out of the labels at write time, indexed
            query = query.where(events.c.job == job)
        if labels:  # the sandbox's labels, in SQL: node events have no sandbox and drop out
            query = query.join(sandboxes, events.c.sandbox_id == sandboxes.c.id)
            for key, value in labels.items():
                query = query.where(sandboxes.c.labels[key].as_string() == value)
        with self._engine.connect() as conn:
            return [dict(row) for row in conn.execute(query).mappings()]

    def last_id(self) -> int:
        with self._engine.connect() as conn:
            return int(conn.execute(select(events.c.id).order_by(events.c.id.desc()).limit(1)).scalar() or 0)

    def prune(self, retention_s: float) -> int:
        """Delete events older than ``retention_s``; how many went."""
        with self._engine.begin() as conn:
            return conn.execute(delete(events).where(events.c.at < time.time() - retention_s)).rowcount
