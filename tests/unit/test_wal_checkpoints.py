"""SQLite's checkpoints run on the state store's own thread (corral/state/checkpoints.py), not inside the commits the
gateway's event loop makes: the serving connections checkpoint only at the backstop, and the thread copies the
write-ahead log back into the database while writes go on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import create_engine, event, text

from corral.state.checkpoints import BACKSTOP_PAGES
from corral.state.db import StateStore, _sqlite_pragmas

ROW = "x" * 4000
WRITES = 40  # transactions of 128 rows (~0.5 MiB each): ~20 MiB of log, past SQLite's own 4 MiB, below the backstop
WRITTEN_BYTES = WRITES * 128 * len(ROW)


def _checkpoint_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "corral-sqlite-checkpoints"}


def _write(database: Path, *, wait_s: float) -> int:
    """WRITES transactions through a pooled engine with the store's pragmas, as the gateway's writes go; then the
    database file's size (what was copied back into it) once it holds them all, or after ``wait_s``."""
    engine = create_engine(f"sqlite:///{database}")
    event.listen(engine, "connect", _sqlite_pragmas)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE filler (body TEXT)"))
        for _ in range(WRITES):
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO filler (body) VALUES (:body)"), [{"body": ROW}] * 128)
            time.sleep(0.02)
        deadline = time.monotonic() + wait_s
        while database.stat().st_size < WRITTEN_BYTES and time.monotonic() < deadline:
            time.sleep(0.1)
        return database.stat().st_size
    finally:
        engine.dispose()


def test_the_log_is_copied_back_by_the_stores_thread_not_by_the_writers(tmp_path: Path) -> None:
    mine = tmp_path / "state.db"
    others = _checkpoint_threads()  # other tests' stores
    store = StateStore(f"sqlite:///{mine}")
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == BACKSTOP_PAGES
        copied = _write(mine, wait_s=5)
    finally:
        store.close()
    assert _checkpoint_threads() <= others  # this store's stopped with close()
    # The same writes with the same pragmas and no store (so no thread): no commit reaches the backstop, so nothing
    # is copied back and the database file stays as it was made.
    alone = _write(tmp_path / "alone.db", wait_s=0.5)
    assert alone < 1 << 20, alone
    assert copied >= WRITTEN_BYTES, copied


def test_a_store_dropped_without_close_stops_its_thread(tmp_path: Path) -> None:
    others = _checkpoint_threads()
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    started = _checkpoint_threads() - others
    assert len(started) == 1
    del store  # not closed: its finalizer asks the thread to stop
    (thread,) = started
    thread.join(timeout=5)
    assert not thread.is_alive()
