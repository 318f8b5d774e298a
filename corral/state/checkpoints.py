"""SQLite's write-ahead log copied back into the database (checkpoints) on a thread of its own, off the event loop.

Why: SQLite runs a checkpoint inside the commit that takes the log past ``wal_autocheckpoint`` pages (1,000 by
default), and on SQLite the gateway's writes run on its event loop (state/thread.py): that commit then copies ~4 MiB
and syncs the files while every request waits. Measured (the trajectory log's appends, 16 rows a transaction, 1,500
transactions, on this machine's disk): 171 µs a row on average with the automatic checkpoints against 117 µs with
none, and a transaction's p99 25 ms against 2.4 ms: a third of the writes' cost and the loop's longest stalls. Here a
thread runs PASSIVE checkpoints, which wait for no lock and block no reader or writer (a writer appends while one
runs); the serving connections keep an automatic checkpoint only as a backstop far above (``BACKSTOP_PAGES``), for a
log this thread could not keep up with.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

__all__ = ["BACKSTOP_PAGES", "WalCheckpoints"]

log = logging.getLogger(__name__)

BACKSTOP_PAGES = 16_384
"""The serving connections' ``wal_autocheckpoint``: 64 MiB of log with 4 KiB pages, where a commit checkpoints
inline after all (16× SQLite's default)."""

_INTERVAL_S = 0.2  # a round when nothing was written is a look at the log's index: microseconds


class WalCheckpoints:
    """A daemon thread with a connection of its own to ``database`` that checkpoints its log every
    ``_INTERVAL_S``. ``close`` stops it; it stops by itself once the database file is gone."""

    def __init__(self, database: Path) -> None:
        self._database = database
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="corral-sqlite-checkpoints", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self._database, isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            log.exception("SQLite checkpoints: cannot open %s; commits checkpoint at the backstop", self._database)
            return
        try:
            while not self._stop.wait(_INTERVAL_S) and self._database.exists():
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # stepped to its end: holds no read
                except sqlite3.Error as exc:  # e.g. the file went with its directory: try again next round
                    log.debug("SQLite checkpoint of %s failed: %s", self._database, exc)
        finally:
            conn.close()

    def stop(self) -> None:
        """Ask the thread to stop, without waiting for it (what a store left unclosed does as it goes)."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
