"""The state store's own thread: the gateway's event loop never waits on the database.

Every StateStore call the gateway makes runs on one thread of its own, in the order the calls were made. A
PostgreSQL round trip or an SQLite fsync then stalls nothing but the callers that wait for that answer, while
every other request (exec, files, streams: no database at all) goes on. One thread, not a pool: SQLite has one
writer anyway, order is kept for free (an ``end`` submitted before a ``get`` is seen by it), and the group
commit (gateway/service.py) batches whatever arrives while a transaction runs into the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["DatabaseThread"]

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


class DatabaseThread:
    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-state")

    async def run(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``call(*args, **kwargs)`` on the database thread, awaited."""
        return await asyncio.wrap_future(self._executor.submit(call, *args, **kwargs))

    def submit(self, call: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
        """Queue a write from code that cannot await (an edge's event callback); a failure is logged. Later calls
        (awaited or not) see its effect, since they run after it on the same thread."""
        future = self._executor.submit(call, *args, **kwargs)
        future.add_done_callback(_log_failure)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._executor.shutdown(wait=True)


def _log_failure(future: concurrent.futures.Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a state write failed", exc_info=future.exception())
