"""A Core statement compiled once and run on the database driver's cursor, for the few statements on every step's
path (the trajectory log's begin and finish).

SQLAlchemy's per-execution work (an execution context, each parameter processed, a result object) cost more than
the database did for them: the trajectory log alone, 16 steps a transaction, by hand (docs/spec.md), SQLite a begin
71-80 us and a finish 38-45 us through ``Connection.execute`` against 40-48 and 24 us here; PostgreSQL 157-165 and
137-164 us against 105-127 and 92-97 us. The SQL is still SQLAlchemy's (compiled for
the engine's dialect, with its casts and paramstyle), the connection and its transaction still SQLAlchemy's; what a
statement raises is translated as SQLAlchemy translates it (``IntegrityError`` and the rest, a lost connection
invalidated), and its cursor events fire for listeners (tests count statements by them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from corral.state import json_text

__all__ = ["DriverStatement", "Sent", "pipeline"]


class DriverStatement:
    """``statement`` compiled for ``dialect``; ``json_params``: the parameters bound to JSON columns, which are
    passed as the values they hold and written as the engine writes them (``json_text``; None is SQL NULL, as the
    columns' ``none_as_null``). Every other parameter goes to the driver as it is: only types the driver takes as
    they are (str, int, float, bool, None)."""

    def __init__(
        self,
        statement: ClauseElement,
        dialect: Dialect,
        *,
        json_params: Iterable[str] = (),
        column_keys: list[str] | None = None,
    ) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=column_keys)
        if not isinstance(compiled, SQLCompiler):  # DDL: nothing on a step's path
            raise TypeError(f"not a statement with parameters: {statement}")
        self.sql = compiled.string
        names = compiled.params  # every parameter's name: a literal's with its value
        self._required = frozenset(name for name in names if compiled.binds[name].required)
        self._defaults = {name: value for name, value in names.items() if name not in self._required}
        self._positions = compiled.positiontup  # the names in order for a positional paramstyle, else None
        self._json = frozenset(json_params)
        if unknown := self._json - self._required:
            raise ValueError(f"no such parameters in the statement: {sorted(unknown)}")

    def parameters(self, values: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        """The driver's parameters for ``values`` (each named parameter the statement has no literal for)."""
        if missing := self._required - values.keys():
            raise ValueError(f"a value is required for parameters {sorted(missing)}")
        merged = {**self._defaults, **values}
        for name in self._json:
            if merged[name] is not None:
                merged[name] = json_text.dumps(merged[name])
        if self._positions is None:
            return merged
        return tuple(merged[name] for name in self._positions)

    def run(self, conn: Connection, values: Mapping[str, Any]) -> tuple[int, Any]:
        """Execute on ``conn`` (in whatever transaction it is in): the rows it changed, and the first column of its
        first row (a RETURNING's) or None."""
        return self.send(conn, values).receive()

    def send(self, conn: Connection, values: Mapping[str, Any]) -> Sent:
        """Execute on ``conn`` without reading the answer: in a ``pipeline`` the statement goes without waiting for
        it, and ``receive`` reads it once the pipeline has ended; elsewhere it has run when this returns."""
        parameters = self.parameters(values)
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection is not None  # a Connection's own is there until it is closed or invalidated
        cursor = dbapi_connection.cursor()
        try:
            sql, parameters = self._before(conn, cursor, parameters)
            with _translated(conn, cursor, sql, parameters):
                cursor.execute(sql, parameters)
        except BaseException:
            cursor.close()
            raise
        return Sent(self, conn, cursor, sql, parameters)

    def _before(self, conn: Connection, cursor: Any, parameters: Any) -> tuple[str, Any]:  # noqa: ANN401 - driver's
        sql = self.sql
        if conn._has_events or conn.engine._has_events:  # as Connection's own execute asks
            for listener in conn.dispatch.before_cursor_execute:
                sql, parameters = listener(conn, cursor, sql, parameters, None, False)
        return sql, parameters

    def _after(self, conn: Connection, cursor: Any, sql: str, parameters: Any) -> None:  # noqa: ANN401 - driver's
        if conn._has_events or conn.engine._has_events:
            conn.dispatch.after_cursor_execute(conn, cursor, sql, parameters, None, False)


class Sent:
    """A statement sent by ``DriverStatement.send``, its answer not read yet."""

    def __init__(self, statement: DriverStatement, conn: Connection, cursor: Any, sql: str, parameters: Any) -> None:  # noqa: ANN401
        self._statement = statement
        self._conn = conn
        self._cursor = cursor
        self._sql = sql
        self._parameters = parameters

    def receive(self) -> tuple[int, Any]:
        """The rows it changed, and the first column of its first row (a RETURNING's) or None."""
        cursor = self._cursor
        try:
            with _translated(self._conn, cursor, self._sql, self._parameters):
                row = cursor.fetchone() if cursor.description else None
            self._statement._after(self._conn, cursor, self._sql, self._parameters)
            return cursor.rowcount, row[0] if row else None
        finally:
            cursor.close()


@contextmanager
def pipeline(conn: Connection) -> Iterator[None]:
    """The driver's pipeline mode on ``conn`` where it has one (psycopg, PostgreSQL): statements sent in the block go
    one after another without waiting for each answer, and leaving the block waits for them all (a statement's
    error is raised there, translated). Eight of a step's begins in one transaction, by hand: 0.66-0.71 ms against
    1.39-1.58 ms one at a time, 0.42-0.46 ms of CPU against 0.68-0.76. Elsewhere (SQLite) each statement runs as it
    is sent."""
    dbapi_connection = conn.connection.dbapi_connection
    start = getattr(dbapi_connection, "pipeline", None)
    if start is None:
        yield
        return
    with _translated(conn, None, "(the statements of a pipeline)", None), start():
        yield


@contextmanager
def _translated(conn: Connection, cursor: Any, sql: str, parameters: Any) -> Iterator[None]:  # noqa: ANN401
    """The driver's errors as SQLAlchemy raises them (``IntegrityError`` and the rest); a lost connection invalidated,
    so the pool never hands it out again."""
    dialect = conn.dialect
    try:
        yield
    except dialect.loaded_dbapi.Error as exc:
        lost = dialect.is_disconnect(exc, conn.connection.dbapi_connection, cursor)
        if lost:
            conn.invalidate(exc)
        raise DBAPIError.instance(
            sql, parameters, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
        ) from exc
