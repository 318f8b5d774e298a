"""Durable control-plane state: the schema, the engine, and the sandbox records.

SQLAlchemy Core with one schema for SQLite (the embedded default, WAL mode)
and PostgreSQL (shared by several gateways later). The edge keeps live state
in memory; the sandboxes table is what survives a restart and what `list`
reads. The layer catalogue (layers, image tags, build cache) has its tables
here too and its logic in corral/images/catalogue.py.
"""

from __future__ import annotations

import builtins
import functools
import time
import weakref
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DefaultClause,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    create_engine,
    event,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.types import ARRAY

from corral.api.errors import ServerUnavailable
from corral.api.models import SandboxState
from corral.state import json_text
from corral.state.checkpoints import BACKSTOP_PAGES, WalCheckpoints
from corral.state.records import JOB_LABEL, SandboxRecord

__all__ = [
    "EVENT_KINDS",
    "StateStore",
    "database_unreachable",
    "unreachable_error",
    "events",
    "write_events",
    "layers",
    "image_tags",
    "build_cache",
    "job_tokens",
    "nodes",
]

metadata = MetaData()

sandboxes = Table(
    "sandboxes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("edge_id", String(32), nullable=False, index=True),
    Column("state", String(16), nullable=False, index=True),
    Column("image", String(256), nullable=False),
    Column("backend", String(32), nullable=False),
    Column("runtime", String(32), nullable=False),
    Column("cpu", Float, nullable=False),
    Column("qos", String(16), nullable=False, server_default="latency"),  # CPU class: latency | batch
    Column("memory_mb", Integer, nullable=False),
    Column("pids_max", Integer, nullable=False),
    Column("user", String(256), nullable=False),
    Column("cwd", Text, nullable=False),
    Column("env", JSON, nullable=False),
    Column("layers", JSON, nullable=False),
    Column("labels", JSON, nullable=False),
    Column("node_selector", JSON, nullable=False, server_default="{}"),  # node labels it was placed by
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True, index=True),
    Column("ttl_counts_paused", Boolean, nullable=False, default=False),
    Column("idle_pause_s", Float, nullable=True),
    Column("paused_at", Float, nullable=True),
    Column("network", JSON, nullable=True),  # NetworkPolicy as JSON; null = loopback only
    Column("protected_paths", JSON, nullable=True),
    Column("sensitive_paths", JSON, nullable=True),
    Column("disk_mb", Integer, nullable=True),
    Column("ended_at", Float, nullable=True),
    Column("end_reason", String(32), nullable=True),
    Column("status_message", Text, nullable=True),
    # labels["job"] copied out, so a job's sandboxes are found by index among hundreds of thousands
    Column("job", String(128), nullable=True, index=True),
)

layers = Table(
    "layers",
    metadata,
    Column("digest", String(80), primary_key=True),
    Column("size_bytes", Integer, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("parents", JSON, nullable=False),  # digests of the layers it was built on, bottom first
    Column("source", JSON, nullable=False),  # how it was built: builder and inputs
    Column("labels", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("last_used_at", Float, nullable=True),  # last sandbox create that stacked it (LRU eviction)
)

image_tags = Table(
    "image_tags",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("version", String(128), primary_key=True),
    Column("layers", JSON, nullable=False),  # digests, bottom first
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("config", JSON, nullable=True),  # ImageConfig (env, working dir, user, ...); null = none
    Column("origin", JSON, nullable=True),  # pulled images: ImageOrigin (registry reference, manifest digest)
)

build_cache = Table(
    "build_cache",
    metadata,
    Column("input_key", String(80), primary_key=True),  # sha256 of the builder's canonical inputs
    Column("layers", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("config", JSON, nullable=True),  # the ImageConfig the build produced; null = none
)

nodes = Table(
    "nodes",
    metadata,
    Column("edge_id", String(32), primary_key=True),
    Column("state", String(16), nullable=False),  # up | lost
    Column("last_seen", Float, nullable=False),  # the edge's last heartbeat, Unix time
    Column("load", JSON, nullable=False),  # EdgeLoad at that heartbeat
    Column("lost_at", Float, nullable=True),
)

job_tokens = Table(
    "job_tokens",
    metadata,
    Column("token_sha256", String(64), primary_key=True),  # the token itself is never stored
    Column("job", String(128), nullable=False, index=True),
    Column("created_at", Float, nullable=False),
)

# What happened, in order: the lifecycle of sandboxes and nodes and the audit findings, one row each, read by
# GET /v1/events (corral/state/events.py). Written in the same transaction as the change it reports, so a
# client resuming from an id misses nothing and sees nothing that did not happen.
events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False, index=True),  # Unix time; retention deletes by it
    Column("kind", String(32), nullable=False),  # EVENT_KINDS
    Column("sandbox_id", String(64), nullable=True, index=True),
    Column("edge_id", String(32), nullable=True),
    Column("job", String(128), nullable=True, index=True),  # the sandbox's job label: a job token sees its own
    Column("detail", JSON, nullable=False),
)
EVENT_KINDS = (
    "sandbox.running", "sandbox.paused", "sandbox.resumed", "sandbox.ended", "node.up", "node.lost", "node.back",
    "audit",
)  # fmt: skip

# A record's columns in its fields' order: rows construct records positionally.
_RECORD_SELECT = select(*(sandboxes.c[name] for name in SandboxRecord.field_names()))
_ACTIVE = (SandboxState.CREATING.value, SandboxState.RUNNING.value, SandboxState.PAUSED.value)
# The TTLs of the sandboxes not ended: what the TTL check reads every second. Its full index on expires_at also
# holds every ended record's (their TTLs stay), and without statistics SQLite answered the check from the state
# index, every live record: 16.6 ms of the gateway's event loop a second with 100,000 live (by hand, 2026-12-07).
Index(
    "ix_sandboxes_live_expiry", sandboxes.c.expires_at,
    sqlite_where=sandboxes.c.state.in_(_ACTIVE), postgresql_where=sandboxes.c.state.in_(_ACTIVE),
)  # fmt: skip
# The TTL check over it. Its states are written out: a planner uses a partial index only for a query whose terms
# imply the index's own, with the same constants (not parameters); SQLite is told to, having no statistics to choose
# it by (``INDEXED BY``: an error, not a scan of every record, if it ever could not).
_EXPIRED_WHERE = (
    f"WHERE expires_at <= :now AND state IN ({', '.join(repr(state) for state in _ACTIVE)})"
    f" AND (state <> '{SandboxState.PAUSED.value}' OR ttl_counts_paused)"
)  # fmt: skip
_EXPIRED = {
    False: text(f"SELECT id FROM sandboxes INDEXED BY ix_sandboxes_live_expiry {_EXPIRED_WHERE}"),
    True: text(f"SELECT id FROM sandboxes {_EXPIRED_WHERE}"),
}
# Built once: SQLAlchemy builds a statement made per call anew and walks it for its cache key, more than half of a
# record's read (240 vs 105 us on SQLite); every E2B data-plane request and GET of a sandbox reads one.
_RECORD_BY_ID = _RECORD_SELECT.where(sandboxes.c.id == bindparam("sandbox_id"))
_RECORDS_BY_IDS = {
    False: _RECORD_SELECT.where(sandboxes.c.id.in_(bindparam("ids", expanding=True))),
    True: _RECORD_SELECT.where(sandboxes.c.id == any_(bindparam("ids", type_=ARRAY(String)))),
}
# A sandbox's pause, resume and end, built once too (each cost 0.2-0.3 ms of building and keying on SQLite).
_CHANGED = (sandboxes.c.id, sandboxes.c.edge_id, sandboxes.c.job)  # what an event names
_PAUSE = (
    update(sandboxes)
    .where(sandboxes.c.id == bindparam("b_id"), sandboxes.c.state == SandboxState.RUNNING.value)
    .values(state=SandboxState.PAUSED.value, paused_at=bindparam("b_at"))
    .returning(*_CHANGED)
)
_RESUMING = select(
    *_CHANGED, sandboxes.c.state, sandboxes.c.expires_at, sandboxes.c.ttl_counts_paused, sandboxes.c.paused_at
).where(sandboxes.c.id == bindparam("b_id"))
_RESUME = (
    update(sandboxes)
    .where(sandboxes.c.id == bindparam("b_id"))
    .values(state=SandboxState.RUNNING.value, paused_at=None, expires_at=bindparam("b_expires_at"))
)
_END = {
    if_creating: update(sandboxes)
    .where(
        sandboxes.c.id == bindparam("b_id"),
        sandboxes.c.state.in_([SandboxState.CREATING.value] if if_creating else _ACTIVE),
    )
    .values(
        state=bindparam("b_state"),
        end_reason=bindparam("b_reason"),
        ended_at=bindparam("b_at"),
        status_message=bindparam("b_message"),
    )
    .returning(*_CHANGED)
    for if_creating in (False, True)
}
_EVENT_INSERT = events.insert()
_IN_CHUNK = 500  # ids per IN (...) list: SQLite caps the parameters of one statement


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")  # WalCheckpoints checkpoints, off the loop
    cursor.close()


def _add_missing_columns(engine: Engine) -> None:
    """A database made by an older version lacks the columns added since (protected_paths, disk_mb,
    sensitive_paths, qos, node_selector, ...): add them, empty or with their default. create_all makes missing tables,
    never missing columns."""
    existing = inspect(engine)
    for table in metadata.sorted_tables:
        if not existing.has_table(table.name):
            continue
        present = {column["name"] for column in existing.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            kind = column.type.compile(dialect=engine.dialect)
            if column.nullable:
                ddl = f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'
            elif isinstance(column.server_default, DefaultClause):  # e.g. qos: old rows get the default
                default = str(column.server_default.arg).replace("'", "''")
                ddl = f"ALTER TABLE {table.name} ADD COLUMN \"{column.name}\" {kind} NOT NULL DEFAULT '{default}'"
            else:
                continue
            with engine.begin() as conn:
                conn.execute(text(ddl))
                if table is sandboxes and column.name == "job":
                    conn.execute(update(sandboxes).values(job=sandboxes.c.labels["job"].as_string()))
        for index in table.indexes:
            index.create(engine, checkfirst=True)


@functools.cache
def _claimable(pool_label: str, postgres: bool) -> Any:  # noqa: ANN401 - a SQL statement
    """Of the ids (an expanding parameter), those running and still carrying the pool's label; locked on
    PostgreSQL until the claim commits. Built once: building a statement costs more than running it here. On SQLite
    each id by its key, not every running record by the state index (``_unindexed_state``)."""
    state = sandboxes.c.state if postgres else _unindexed_state()
    return (
        select(sandboxes.c.id, sandboxes.c.edge_id)
        .where(
            sandboxes.c.id.in_(bindparam("ids", expanding=True)),
            state == SandboxState.RUNNING.value,
            sandboxes.c.labels[pool_label].as_string().is_not(None),
        )
        .with_for_update()
    )


@functools.cache
def _claim_update(fields: tuple[str, ...]) -> Any:  # noqa: ANN401 - a SQL statement
    """One claimed record's new values (an executemany over the claims), built once per set of fields."""
    values: dict[str, Any] = {name: bindparam(f"new_{name}") for name in (*fields, "job")}
    return update(sandboxes).where(sandboxes.c.id == bindparam("claimed_id")).values(values)


def _ids_in_states(postgres: bool, states: tuple[str, ...]) -> Any:  # noqa: ANN401 - a SQL expression
    """The sandboxes of the ``ids`` parameter in one of ``states``, each found by its primary key. On PostgreSQL the
    ids go as one array parameter (one statement text for any count), and one state is tested in a way the planner
    cannot answer from the state index (``IS NOT DISTINCT FROM``, the same as ``=`` on a NOT NULL column): it takes
    that index when its statistics say few rows are creating, but the index keeps a ``creating`` entry for every
    record created since the last vacuum (the bench's marks read ~9,000 entries each); the primary key finds each
    id at the same cost however many records came before. On SQLite an expanding ``IN``, and the state tested as
    ``state || ''`` (``_unindexed_state``) for the same reason."""
    if postgres:
        state = sandboxes.c.state
        return and_(
            sandboxes.c.id == any_(bindparam("ids", type_=ARRAY(String))),
            state.is_not_distinct_from(states[0]) if len(states) == 1 else state.in_(states),
        )
    return and_(sandboxes.c.id.in_(bindparam("ids", expanding=True)), _unindexed_state().in_(states))


def _unindexed_state() -> Any:  # noqa: ANN401 - a SQL expression
    """SQLite: the state column as an expression (``state || ''``, the same text), which its planner cannot answer
    from the state index. Given a list of ids and a state, it otherwise takes that index once the list is long
    (~200 ids, no statistics): an end of 200 running sandboxes read every running record's entry, 213 against 27 µs
    an id with 100,000 records live (by hand, 2026-12-07); the primary key finds each id however many there are."""
    return sandboxes.c.state.concat("")


# creating -> running, built once per dialect: building it anew cost ~0.3 ms of a single create's mark on SQLite
# (0.36-0.47 vs 0.62-0.78 ms, with its event and commit).
_MARK_RUNNING = {
    postgres: update(sandboxes)
    .where(_ids_in_states(postgres, (SandboxState.CREATING.value,)))
    .values(state=SandboxState.RUNNING.value, status_message=bindparam("b_note"))
    .returning(*_CHANGED)
    for postgres in (False, True)
}


# Several sandboxes ended at once (concurrent kills), each row given back whole, its job last (for its event).
_END_MANY = {
    postgres: update(sandboxes)
    .where(_ids_in_states(postgres, _ACTIVE))
    .values(
        state=bindparam("b_state"),
        end_reason=bindparam("b_reason"),
        ended_at=bindparam("b_at"),
        status_message=bindparam("b_message"),
    )
    .returning(*(sandboxes.c[name] for name in SandboxRecord.field_names()), sandboxes.c.job)
    for postgres in (False, True)
}


def _row_layout(table: Table, rows: list[dict[str, Any]]) -> tuple[str, list[tuple[str, Any, bool]]]:
    """The quoted column list of a batch of ``rows`` and, per column, (name, Python-side default, is JSON): the
    columns the rows have, and those missing from them that have a scalar Python-side default (the others get
    their server default)."""
    present = rows[0].keys()
    columns = [c for c in table.columns if c.name in present or (c.default is not None and c.default.is_scalar)]
    fields = [(c.name, getattr(c.default, "arg", None), isinstance(c.type, JSON)) for c in columns]
    return ", ".join(f'"{c.name}"' for c in columns), fields


def _row_values(row: dict[str, Any], fields: list[tuple[str, Any, bool]]) -> list[Any]:
    """A row's values as SQLAlchemy would bind them: JSON columns as ``json_text.dumps`` of the value (None as JSON
    null), a missing column as its Python-side default."""
    return [_json_text(row.get(name, default)) if is_json else row.get(name, default)
            for name, default, is_json in fields]  # fmt: skip


def _copy_rows(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Rows into a PostgreSQL table by COPY ... FROM STDIN, in the connection's transaction: what an executemany
    INSERT stores, at a fraction of the work (psycopg would send one INSERT per row, each parsed and bound by the
    server)."""
    names, fields = _row_layout(table, rows)
    driver = conn.connection.driver_connection
    assert driver is not None  # an open connection has its DBAPI connection
    with driver.cursor() as cursor, cursor.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(_row_values(row, fields))


def _insert_rows(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Rows into a SQLite table, in the connection's transaction: one executemany of positional values built as
    ``_copy_rows`` builds them. SQLAlchemy's own executemany ran a bind processor per value and built a
    parameter dict per row, which cost more than SQLite's work (py-spy over a 32,000 burst: 9.4 of the 18.3% of
    samples in the records' insert)."""
    names, fields = _row_layout(table, rows)
    marks = ", ".join("?" * len(fields))
    conn.exec_driver_sql(f"INSERT INTO {table.name} ({names}) VALUES ({marks})",
                         [tuple(_row_values(row, fields)) for row in rows])  # fmt: skip


def _sandbox_events(
    conn: Connection, kind: str, rows: Iterable[Sequence[Any]], at: float, detail: dict[str, Any], postgres: bool
) -> None:
    """One event per sandbox row (id, edge_id, job: what an UPDATE ... RETURNING gave back)."""
    batch = [{"at": at, "kind": kind, "sandbox_id": sandbox_id, "edge_id": edge_id, "job": job, "detail": detail}
             for sandbox_id, edge_id, job in rows]  # fmt: skip
    write_events(conn, batch, postgres)


def write_events(conn: Connection, batch: list[dict[str, Any]], postgres: bool) -> None:
    """Event rows in the caller's transaction; a burst's many by COPY on PostgreSQL."""
    if not batch:
        return
    if len(batch) == 1:
        conn.execute(_EVENT_INSERT, batch)
    elif postgres:
        _copy_rows(conn, events, batch)
    else:
        _insert_rows(conn, events, batch)


def _json_text(value: Any) -> str:  # noqa: ANN401 - any JSON value
    """``json_text.dumps(value)``; the values most records hold (None, an empty list or dict) without the encoder,
    which costs a microsecond a call to set up (seven JSON columns a record)."""
    if value is None:
        return "null"
    if not value and type(value) in (list, dict):
        return "[]" if type(value) is list else "{}"
    return json_text.dumps(value)


def database_unreachable(exc: BaseException) -> bool:
    """Whether an error means the database could not be reached or dropped the connection (a restart, an
    outage), as opposed to a statement it refused: worth retrying once it is back."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def unreachable_error(exc: BaseException) -> ServerUnavailable:
    """What a client gets for such an error: retryable (502), with the driver's first line, no SQL."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ServerUnavailable(f"the state database is unreachable ({first_line}); retry")


POSTGRES_TCP_TIMEOUTS: dict[str, int | str] = {
    "connect_timeout": 10,  # s
    "tcp_user_timeout": 10_000,  # ms that sent data may stay unacknowledged before the connection fails
    "keepalives_idle": 10,  # s; then a probe each 5 s, 3 unanswered end the connection (~25 s)
    "keepalives_interval": 5,
    "keepalives_count": 3,
    # A client cut off mid-transaction holds its row locks until the server notices; 30 s and the server ends
    # it (seen: a cut node's heartbeat UPDATE left idle in transaction blocked the gateway's UPDATE of that row).
    "options": "-c idle_in_transaction_session_timeout=30000",
}
"""libpq's settings for a database over TCP (unix sockets ignore them). Without them a connection whose peer
went silent (a partition, a machine gone) blocks its caller until the kernel gives up (~15 min), and one that
comes back only resumes at TCP's next retransmission (a node cut off for 30 s was heard again 24 s after its
link returned); with them its connections fail
fast, the pool opens new ones, and the node is heard within a heartbeat or two (`corral bench partition`).
The database URL's own parameters win (``?tcp_user_timeout=0`` is the kernel's default again)."""


PING_IDLE_S = 1.0
"""A pooled PostgreSQL connection that sat in the pool this long is pinged as it is checked out, and replaced if
the server went away meanwhile (a restart takes longer than this): the first request after a restart does not
fail on a dead connection. One back in use sooner is not: SQLAlchemy's ``pool_pre_ping`` pinged every checkout, a
round trip before every statement outside a transaction (a step's log writes: 0.4 of 1.7 ms, docs/spec.md)."""


def ping_idle_connections(engine: Engine, idle_s: float = PING_IDLE_S) -> None:
    """``engine``'s pool pings a connection idle ``idle_s`` or longer as it is checked out (a failed ping: the
    pool drops it and checks out another, a new one if it must)."""

    @event.listens_for(engine, "checkin")
    def returned(dbapi_connection: Any, record: Any) -> None:  # noqa: ANN401 - the DBAPI's own types
        record.info["returned_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:  # noqa: ANN401
        returned_at = record.info.get("returned_at")
        if returned_at is None or time.monotonic() - returned_at < idle_s:
            return  # just opened, or in use a moment ago
        try:
            alive = engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError(f"a pooled connection failed its ping: {exc}") from exc
        if not alive:
            raise DisconnectionError("a pooled connection failed its ping")


class StateStore:
    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        sqlite = url.startswith("sqlite")
        parsed = make_url(url)
        libpq = parsed.get_driver_name() in ("psycopg", "psycopg2")
        timeouts = {key: value for key, value in POSTGRES_TCP_TIMEOUTS.items() if key not in parsed.query}
        self._engine: Engine = create_engine(
            url,
            future=True,
            connect_args=timeouts if libpq else {},
            json_serializer=json_text.dumps,
        )
        if not sqlite:
            ping_idle_connections(self._engine)
        if self._engine.dialect.name == "sqlite":
            event.listen(self._engine, "connect", _sqlite_pragmas)
        self._postgres = self._engine.dialect.name == "postgresql"
        # Reads need no transaction: on PostgreSQL one costs a BEGIN and the pool's ROLLBACK on return, two round
        # trips of a record's read (0.71-0.74 vs 0.52-0.56 ms, docs/spec.md). Its default READ COMMITTED gives
        # each statement its own snapshot in a transaction too, so what a read sees is the same.
        self._reads: Engine = (
            self._engine.execution_options(isolation_level="AUTOCOMMIT") if self._postgres else self._engine
        )
        metadata.create_all(self._engine)
        _add_missing_columns(self._engine)
        database = parsed.database if sqlite else None
        self._checkpoints = WalCheckpoints(Path(database)) if database else None
        if self._checkpoints is not None:  # a store dropped without close() stops its thread too
            weakref.finalize(self, self._checkpoints.stop)

    @property
    def engine(self) -> Engine:
        return self._engine

    def insert(self, record: SandboxRecord) -> None:
        with self._engine.begin() as conn:
            conn.execute(sandboxes.insert().values(**record.row()))

    def insert_many(self, records: builtins.list[SandboxRecord]) -> None:
        """Several records in one transaction (the creates of a burst commit together)."""
        rows = [record.row() for record in records]
        with self._engine.begin() as conn:
            if self._postgres:
                _copy_rows(conn, sandboxes, rows)
            else:
                _insert_rows(conn, sandboxes, rows)

    def update(self, sandbox_id: str, **values: Any) -> None:
        with self._engine.begin() as conn:
            conn.execute(update(sandboxes).where(sandboxes.c.id == sandbox_id).values(**values))

    def mark_running(self, sandbox_id: str, status_message: str | None = None) -> bool:
        """creating → running; False if the sandbox was ended meanwhile (killed while it started)."""
        return sandbox_id in self.mark_running_many({sandbox_id: status_message})

    def mark_running_many(self, notes: dict[str, str | None]) -> set[str]:
        """creating → running for several sandboxes in one transaction (id → status note); returns the ids
        that were marked (the others ended meanwhile). One UPDATE ... RETURNING per chunk of ids that share
        a note (a burst's notes are nearly all the same); on PostgreSQL the ids go as one array parameter, one
        statement text for any count (prepared once by psycopg), not chunks of one parameter per id."""
        by_note: dict[str | None, list[str]] = {}
        for sandbox_id, note in notes.items():
            by_note.setdefault(note, []).append(sandbox_id)
        marked: set[str] = set()
        with self._engine.begin() as conn:
            for note, ids in by_note.items():
                for chunk in self._id_chunks(ids):
                    rows = conn.execute(_MARK_RUNNING[self._postgres], {"ids": chunk, "b_note": note}).all()
                    _sandbox_events(conn, "sandbox.running", rows, time.time(), {}, self._postgres)
                    marked.update(row.id for row in rows)
        return marked

    def claim_many(self, claims: dict[str, dict[str, Any]], *, pool_label: str) -> set[str]:
        """Warm-pool sandboxes handed to their clients, in one transaction: each record that is running and still
        carries ``pool_label`` (no claim took it yet, from this gateway or another sharing the store) takes the
        client's values (labels, env, TTL, ...; every claim sets the same fields) and gets a ``sandbox.running``
        event under the client's job; returns the ids claimed (the others were claimed, paused or ended meanwhile).
        Three statements for any count (the claimable rows, locked on PostgreSQL; one executemany UPDATE; the
        events): a statement per claim cost ~0.8 ms each, more than the rest of a claim."""
        if not claims:
            return set()
        fields = tuple(sorted(next(iter(claims.values()))))
        ids = list(claims)
        with self._engine.begin() as conn:
            claimable: dict[str, str] = {}  # id -> edge id
            for chunk in (ids[i : i + _IN_CHUNK] for i in range(0, len(ids), _IN_CHUNK)):
                rows = conn.execute(_claimable(pool_label, self._postgres), {"ids": chunk}).all()
                claimable.update((sandbox_id, edge_id) for sandbox_id, edge_id in rows)
            if not claimable:
                return set()
            statement = _claim_update(fields)
            jobs = {sandbox_id: claims[sandbox_id]["labels"].get(JOB_LABEL) for sandbox_id in claimable}
            conn.execute(statement, [
                {"claimed_id": sandbox_id, "new_job": jobs[sandbox_id],
                 **{f"new_{name}": claims[sandbox_id][name] for name in fields}}
                for sandbox_id in claimable
            ])  # fmt: skip
            running = [(sandbox_id, edge_id, jobs[sandbox_id]) for sandbox_id, edge_id in claimable.items()]
            _sandbox_events(conn, "sandbox.running", running, time.time(), {"warm": True}, self._postgres)
        return set(claimable)

    def end(
        self, sandbox_id: str, state: SandboxState, reason: str, message: str | None = None, *,
        if_creating: bool = False,
    ) -> bool:  # fmt: skip
        """Mark an active sandbox ended (with ``if_creating``: only one still creating); False if it was not."""
        now = time.time()
        with self._engine.begin() as conn:
            values = {"b_id": sandbox_id, "b_state": state.value, "b_reason": reason, "b_at": now, "b_message": message}
            rows = conn.execute(_END[if_creating], values).all()
            detail = {"state": state.value, "reason": reason, "message": message}
            _sandbox_events(conn, "sandbox.ended", rows, now, detail, self._postgres)
            return bool(rows)

    def end_many(self, ends: dict[str, tuple[SandboxState, str, str | None]]) -> dict[str, SandboxRecord]:
        """Active sandboxes marked ended in one transaction (id → (state, reason, message)): concurrent kills
        commit together. Returns each sandbox it ended as its record now is, by id; an id missing from it had
        ended already. One UPDATE ... RETURNING per chunk of ids that share an end; the ended records come back
        from it whole, so a kill answers without reading its record again."""
        by_end: dict[tuple[SandboxState, str, str | None], list[str]] = {}
        for sandbox_id, end in ends.items():
            by_end.setdefault(end, []).append(sandbox_id)
        now = time.time()
        ended: dict[str, SandboxRecord] = {}
        with self._engine.begin() as conn:
            for (state, reason, message), ids in by_end.items():
                values = {"b_state": state.value, "b_reason": reason, "b_at": now, "b_message": message}
                detail = {"state": state.value, "reason": reason, "message": message}
                for chunk in self._id_chunks(ids):
                    rows = conn.execute(_END_MANY[self._postgres], {"ids": chunk, **values}).all()
                    _sandbox_events(conn, "sandbox.ended", [(row.id, row.edge_id, row.job) for row in rows], now,
                                    detail, self._postgres)  # fmt: skip
                    ended.update((row.id, SandboxRecord(*row[:-1])) for row in rows)
        return ended

    # -- nodes (the watcher) ----------------------------------------------

    def heartbeat(self, edge_id: str, load: dict[str, Any], now: float) -> bool:
        """An edge is alive: record when, and its load; a node marked lost comes back up (then True)."""
        return edge_id in self.heartbeat_many({edge_id: load}, now)

    def heartbeat_many(self, loads: dict[str, dict[str, Any]], now: float) -> set[str]:
        """Several edges are alive (edge id → load): one transaction for all of them, not one per edge (a
        gateway with 160 edges heartbeats them every second). Returns those that were marked lost (now up)."""
        if not loads:
            return set()
        edge_ids = list(loads)
        with self._engine.begin() as conn:
            known: dict[str, str] = {}
            for start in range(0, len(edge_ids), _IN_CHUNK):
                chunk = edge_ids[start : start + _IN_CHUNK]
                query = select(nodes.c.edge_id, nodes.c.state).where(nodes.c.edge_id.in_(chunk))
                known.update((row.edge_id, row.state) for row in conn.execute(query))
            beats = [
                {"beat_edge_id": edge_id, "beat_load": load} for edge_id, load in loads.items() if edge_id in known
            ]
            if beats:
                statement = (
                    update(nodes)
                    .where(nodes.c.edge_id == bindparam("beat_edge_id"))
                    .values(state="up", last_seen=now, load=bindparam("beat_load", type_=nodes.c.load.type))
                )
                conn.execute(statement, beats)
            new = [{"edge_id": e, "state": "up", "last_seen": now, "load": load} for e, load in loads.items()
                   if e not in known]  # fmt: skip
            if new:
                conn.execute(nodes.insert(), new)
            back = {edge_id for edge_id, state in known.items() if state == "lost"}
            batch = [{"at": now, "kind": "node.up", "sandbox_id": None, "edge_id": row["edge_id"], "job": None,
                      "detail": {}} for row in new]  # fmt: skip
            batch += [{"at": now, "kind": "node.back", "sandbox_id": None, "edge_id": edge_id, "job": None,
                       "detail": {}} for edge_id in sorted(back)]  # fmt: skip
            write_events(conn, batch, self._postgres)
        return back

    def creating_before(self, edge_id: str, before: float) -> builtins.list[str]:
        """Ids of an edge's sandboxes still creating that were recorded before ``before`` (wall clock)."""
        query = select(sandboxes.c.id).where(
            sandboxes.c.edge_id == edge_id, sandboxes.c.state == SandboxState.CREATING.value,
            sandboxes.c.created_at < before,
        )  # fmt: skip
        with self._reads.connect() as conn:
            return [row.id for row in conn.execute(query)]

    def active_ids(self, edge_id: str) -> set[str]:
        """Ids of the sandboxes the records say are active on an edge."""
        query = select(sandboxes.c.id).where(sandboxes.c.edge_id == edge_id, sandboxes.c.state.in_(_ACTIVE))
        with self._reads.connect() as conn:
            return {row.id for row in conn.execute(query)}

    def silent_nodes(self, before: float, exclude: set[str]) -> list[str]:
        """Nodes still up whose last heartbeat is older than ``before``."""
        query = select(nodes.c.edge_id).where(nodes.c.state == "up", nodes.c.last_seen < before)
        with self._reads.connect() as conn:
            return [row.edge_id for row in conn.execute(query) if row.edge_id not in exclude]

    def mark_node_lost(self, edge_id: str, before: float, message: str) -> int:
        """Mark a silent node lost (unless it spoke since ``before``) and every active sandbox on it; how many."""
        now = time.time()
        with self._engine.begin() as conn:
            done = conn.execute(
                update(nodes)
                .where(nodes.c.edge_id == edge_id, nodes.c.state == "up", nodes.c.last_seen < before)
                .values(state="lost", lost_at=now)
            )
            if done.rowcount == 0:
                return 0
            ended = conn.execute(
                update(sandboxes)
                .where(sandboxes.c.edge_id == edge_id, sandboxes.c.state.in_(_ACTIVE))
                .values(state=SandboxState.LOST.value, end_reason="lost", ended_at=now, status_message=message)
                .returning(sandboxes.c.id, sandboxes.c.edge_id, sandboxes.c.job)
            ).all()
            node_lost = {"at": now, "kind": "node.lost", "sandbox_id": None, "edge_id": edge_id, "job": None,
                         "detail": {"message": message, "sandboxes_lost": len(ended)}}  # fmt: skip
            write_events(conn, [node_lost], self._postgres)
            detail = {"state": SandboxState.LOST.value, "reason": "lost", "message": message}
            _sandbox_events(conn, "sandbox.ended", ended, now, detail, self._postgres)
            return len(ended)

    def nodes(self) -> list[dict[str, Any]]:
        with self._reads.connect() as conn:
            return [dict(row) for row in conn.execute(select(nodes).order_by(nodes.c.edge_id)).mappings()]

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self._reads.connect() as conn:
            row = conn.execute(_RECORD_BY_ID, {"sandbox_id": sandbox_id}).first()
            return SandboxRecord(*row) if row else None

    def _id_chunks(self, ids: list[str]) -> list[list[str]]:
        """Ids as a statement's parameter takes them: all in one array on PostgreSQL, chunks of ``_IN_CHUNK`` for
        SQLite's expanding ``IN`` (it caps the parameters of one statement)."""
        return [ids] if self._postgres else [ids[i : i + _IN_CHUNK] for i in range(0, len(ids), _IN_CHUNK)]

    def get_many(self, sandbox_ids: Collection[str]) -> dict[str, SandboxRecord]:
        """The records of several ids in one statement (on PostgreSQL the ids as one array parameter, on SQLite
        chunks of an ``IN``), by id; an id with no record is missing from it."""
        found: dict[str, SandboxRecord] = {}
        with self._reads.connect() as conn:
            for chunk in self._id_chunks(list(sandbox_ids)):
                rows = conn.execute(_RECORDS_BY_IDS[self._postgres], {"ids": chunk})
                found.update((row[0], SandboxRecord(*row)) for row in rows)
        return found

    def list(
        self,
        *,
        states: builtins.list[str] | None = None,
        labels: dict[str, str] | None = None,
        edge_id: str | None = None,
    ) -> builtins.list[SandboxRecord]:
        query = _RECORD_SELECT.order_by(sandboxes.c.created_at)
        if states:
            query = query.where(sandboxes.c.state.in_(states))
        if edge_id:
            query = query.where(sandboxes.c.edge_id == edge_id)
        for key, value in (labels or {}).items():  # in SQL: with 400,000 records, not every row into Python
            if key == JOB_LABEL:
                query = query.where(sandboxes.c.job == value)
            else:
                query = query.where(sandboxes.c.labels[key].as_string() == value)
        with self._reads.connect() as conn:
            return [SandboxRecord(*row) for row in conn.execute(query)]

    def layers_in_use(self, edge_ids: Collection[str] | None = None) -> set[str]:
        """The layer digests the active sandboxes stack (of these edges only, when given): what a layer cache
        must keep and a layer helper must go on serving. Reads the one column, not whole records."""
        if edge_ids is not None and not edge_ids:
            return set()
        query = select(sandboxes.c.layers).where(sandboxes.c.state.in_(_ACTIVE))
        if edge_ids is not None:
            query = query.where(sandboxes.c.edge_id.in_(list(edge_ids)))
        with self._reads.connect() as conn:
            return {entry.partition("#")[0] for (stack,) in conn.execute(query) for entry in stack}

    def mark_paused(self, sandbox_id: str, at: float) -> None:
        with self._engine.begin() as conn:
            rows = conn.execute(_PAUSE, {"b_id": sandbox_id, "b_at": at}).all()
            _sandbox_events(conn, "sandbox.paused", rows, at, {}, self._postgres)

    def mark_resumed(self, sandbox_id: str, at: float) -> None:
        """paused → running; unless paused time counts, the TTL moves on by the time spent paused."""
        with self._engine.begin() as conn:
            row = conn.execute(_RESUMING, {"b_id": sandbox_id}).mappings().first()
            if row is None or row["state"] != SandboxState.PAUSED.value:
                return
            expires_at = row["expires_at"]
            if expires_at is not None and not row["ttl_counts_paused"] and row["paused_at"] is not None:
                expires_at += max(0.0, at - row["paused_at"])
            conn.execute(_RESUME, {"b_id": sandbox_id, "b_expires_at": expires_at})
            paused_s = at - row["paused_at"] if row["paused_at"] is not None else None
            _sandbox_events(
                conn,
                "sandbox.resumed",
                [(row["id"], row["edge_id"], row["job"])],
                at,
                {"paused_s": paused_s},
                self._postgres,
            )

    def expired(self, now: float) -> builtins.list[str]:
        """Sandboxes past their TTL; a paused one only if its paused time counts. Read through the TTLs of the
        sandboxes not ended alone (``ix_sandboxes_live_expiry``), however many are live or ever were."""
        with self._reads.connect() as conn:
            return [r[0] for r in conn.execute(_EXPIRED[self._postgres], {"now": now})]

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._engine.dispose()
