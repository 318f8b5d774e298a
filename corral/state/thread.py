"""The state store's own thread: the gateway's event loop never waits on a database server.

On PostgreSQL every StateStore call the gateway makes runs on one thread of its own, in the order the calls
were made. A round trip, a lock wait or a slow server then stalls nothing but the callers that wait for that
answer, while every other request (exec, files, streams: no database at all) goes on. One thread, not a pool:
order is kept for free (an ``end`` submitted before a ``get`` is seen by it), and the group commit
(gateway/service.py) batches whatever arrives while a transaction runs into the next one.

On SQLite (a local file: no network, WAL, fsync only at checkpoints) the calls run inline on the caller's
thread (``inline``): Python's sqlite3 releases the GIL around every row it steps, and a thread that must win
the GIL back from a busy event loop waits the interpreter's switch interval (5 ms) each time, so a batch of
256 inserts on the thread took longer than the whole burst it belonged to (``corral bench control-plane``:
sustained creates 41-311/s against 188-1,944/s inline, paired runs; docs/spec.md).
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
    def __init__(self, *, inline: bool = False) -> None:
        self.inline = inline
        self._executor = (
            None if inline else concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-state")
        )

    async def run(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``call(*args, **kwargs)`` on the database thread, awaited."""
        if self._executor is None:
            return call(*args, **kwargs)
        return await asyncio.wrap_future(self._executor.submit(call, *args, **kwargs))

    def submit(self, call: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
        """Queue a write from code that cannot await (an edge's event callback); a failure is logged. Later calls
        (awaited or not) see its effect, since they run after it on the same thread."""
        if self._executor is None:
            try:
                call(*args, **kwargs)
            except Exception:
                log.exception("a state write failed")
            return
        future = self._executor.submit(call, *args, **kwargs)
        future.add_done_callback(_log_failure)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _log_failure(future: concurrent.futures.Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a state write failed", exc_info=future.exception())
