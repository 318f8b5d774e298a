"""A Core statement run on the driver's cursor (corral/state/driver.py), on a real SQLite file and a real
PostgreSQL: what it writes is what SQLAlchemy's own execute writes, its errors are SQLAlchemy's, a lost
connection is invalidated, and its cursor events fire."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg.pq import PipelineStatus
from sqlalchemy import JSON, Column, Integer, MetaData, String, Table, bindparam, event, insert, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError

from corral.state.db import StateStore
from corral.state.driver import DriverStatement, pipeline

metadata = MetaData()
items = Table(
    "driver_statement_items",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(32), nullable=False, unique=True),
    Column("kind", String(16), nullable=False),
    Column("body", JSON(none_as_null=True), nullable=True),
)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'state.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    metadata.drop_all(store.engine)
    metadata.create_all(store.engine)
    try:
        yield store.engine
    finally:
        metadata.drop_all(store.engine)
        store.close()


def _insert(engine: Engine) -> DriverStatement:
    """An insert with a literal bind (the kind), a JSON parameter and a RETURNING, on conflict nothing."""
    upsert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    values = select(bindparam("b_id", type_=Integer), bindparam("b_name", type_=String), literal("made"),
                    bindparam("b_body", type_=items.c.body.type))  # fmt: skip
    statement = upsert(items).from_select(["id", "name", "kind", "body"], values)
    statement = statement.on_conflict_do_nothing(index_elements=[items.c.id]).returning(items.c.id)
    return DriverStatement(statement, engine.dialect, json_params=["b_body"])


def test_it_writes_what_sqlalchemys_execute_writes(engine: Engine) -> None:
    statement = _insert(engine)
    body = {"cmd": "echo é", "env": {"A": "1"}, "n": 2.5, "list": [1, None, True]}
    with engine.begin() as conn:
        assert statement.run(conn, {"b_id": 1, "b_name": "one", "b_body": body}) == (1, 1)
        assert statement.run(conn, {"b_id": 2, "b_name": "two", "b_body": None})[1] == 2
        assert statement.run(conn, {"b_id": 1, "b_name": "again", "b_body": {}})[1] is None  # the conflict: no row
        conn.execute(insert(items).values(id=3, name="three", kind="made", body=body))  # SQLAlchemy's own
    with engine.connect() as conn:
        rows = conn.execute(select(items).order_by(items.c.id)).all()
        nulls = conn.execute(select(items.c.id).where(items.c.body.is_(None))).scalars().all()
    assert [tuple(row) for row in rows] == [(1, "one", "made", body), (2, "two", "made", None),
                                            (3, "three", "made", body)]  # fmt: skip
    assert nulls == [2]  # None is SQL NULL, not JSON null, as the column's none_as_null says


def test_a_unique_violation_is_sqlalchemys_integrity_error_and_the_transaction_goes_on_after_it(
    engine: Engine,
) -> None:
    statement = _insert(engine)
    with engine.begin() as conn:
        statement.run(conn, {"b_id": 1, "b_name": "one", "b_body": None})
    with pytest.raises(IntegrityError) as raised, engine.begin() as conn:
        statement.run(conn, {"b_id": 2, "b_name": "one", "b_body": None})  # the name is unique
    assert raised.value.statement == statement.sql and not raised.value.connection_invalidated
    with engine.begin() as conn:  # the pool's connection was rolled back and works
        assert statement.run(conn, {"b_id": 2, "b_name": "two", "b_body": None})[1] == 2


def test_its_cursor_events_fire_for_listeners(engine: Engine) -> None:
    seen: list[tuple[str, str]] = []

    def before(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        seen.append(("before", sql))

    def after(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        seen.append(("after", sql))

    statement = _insert(engine)
    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    try:
        with engine.begin() as conn:
            statement.run(conn, {"b_id": 1, "b_name": "one", "b_body": None})
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    assert [entry for entry in seen if entry[1] == statement.sql] == [("before", statement.sql),
                                                                       ("after", statement.sql)]  # fmt: skip


def test_a_missing_or_unknown_parameter_is_named(engine: Engine) -> None:
    statement = _insert(engine)
    with pytest.raises(ValueError, match=r"required for parameters \['b_body', 'b_name'\]"):
        statement.parameters({"b_id": 1})
    with pytest.raises(ValueError, match=r"no such parameters in the statement: \['body'\]"):
        DriverStatement(select(items.c.id), engine.dialect, json_params=["body"])


def test_a_lost_connection_is_invalidated_and_the_next_checkout_works(postgres_url: str) -> None:
    store = StateStore(postgres_url)
    metadata.create_all(store.engine)
    statement = _insert(store.engine)
    try:
        with store.engine.begin() as conn:
            conn.execute(items.delete())
        with store.engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with store.engine.connect() as other:  # the server ends this connection's backend
                other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
            with pytest.raises(DBAPIError) as raised:
                statement.run(conn, {"b_id": 1, "b_name": "one", "b_body": None})
            assert raised.value.connection_invalidated and conn.invalidated  # never back in the pool
        with store.engine.begin() as conn:  # a fresh connection, not the dead one back from the pool
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() != pid
            assert statement.run(conn, {"b_id": 1, "b_name": "one", "b_body": None})[1] == 1
    finally:
        metadata.drop_all(store.engine)
        store.close()


def test_statements_sent_in_a_pipeline_are_answered_after_it_and_its_errors_raised_as_it_ends(engine: Engine) -> None:
    """On PostgreSQL the statements of a pipeline go without waiting for each answer (psycopg's pipeline mode, on
    while they are sent); their answers are read after it. A statement that fails makes the pipeline's end raise
    SQLAlchemy's error. On SQLite each runs as it is sent."""
    statement = _insert(engine)
    modes: list[object] = []

    def note(conn: Any, *_: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        pgconn = getattr(conn.connection.dbapi_connection, "pgconn", None)
        modes.append(PipelineStatus(pgconn.pipeline_status).name if pgconn is not None else "none")

    event.listen(engine, "before_cursor_execute", note)
    try:
        with engine.begin() as conn:
            with pipeline(conn):
                sent = [statement.send(conn, {"b_id": k, "b_name": f"n{k}", "b_body": {"k": k}}) for k in range(1, 9)]
            assert [each.receive() for each in sent] == [(1, k) for k in range(1, 9)]
        with pytest.raises(IntegrityError), engine.begin() as conn, pipeline(conn):
            statement.send(conn, {"b_id": 20, "b_name": "new", "b_body": None})
            statement.send(conn, {"b_id": 21, "b_name": "n1", "b_body": None})  # the name is unique: fails there
            statement.send(conn, {"b_id": 22, "b_name": "newer", "b_body": None})
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert set(modes[:8]) == ({"ON"} if engine.dialect.name == "postgresql" else {"none"})
    with engine.connect() as conn:  # the failed pipeline's transaction was rolled back as a whole
        assert conn.execute(select(items.c.id).order_by(items.c.id)).scalars().all() == list(range(1, 9))
