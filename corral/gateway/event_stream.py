"""GET /v1/events as NDJSON: the events after an id, then (following) new ones as they are written.

Reads run in a worker thread (the state store is synchronous); a follower asks again every
``POLL_S`` when it has caught up, and gets a blank line after ``KEEPALIVE_S`` of quiet so that
proxies and the client's read timeout see the connection alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from corral.api.models import Event
from corral.state.events import EventFilter, EventLog

__all__ = ["KEEPALIVE_S", "follow_events"]

POLL_S = 0.25
KEEPALIVE_S = 15.0
_PAGE = 1000


async def follow_events(log: EventLog, after_id: int, wanted: EventFilter, follow: bool) -> AsyncIterator[bytes]:
    last_sent = time.monotonic()
    while True:
        rows = await asyncio.to_thread(log.read, after_id, wanted, _PAGE)
        for row in rows:
            event = Event(id=row["id"], at=row["at"], kind=row["kind"], sandbox_id=row["sandbox_id"],
                          edge_id=row["edge_id"], detail=row["detail"])  # fmt: skip
            after_id = event.id
            yield event.model_dump_json().encode() + b"\n"
        if rows:
            last_sent = time.monotonic()
        if len(rows) == _PAGE:
            continue  # more are waiting: no pause between pages
        if not follow:
            return
        if time.monotonic() - last_sent >= KEEPALIVE_S:
            last_sent = time.monotonic()
            yield b"\n"
        await asyncio.sleep(POLL_S)
