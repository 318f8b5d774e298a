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

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from corral.state import json_text

__all__ = ["DriverStatement"]


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
        parameters = self.parameters(values)
        dialect = conn.dialect
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection is not None  # a Connection's own is there until it is closed or invalidated
        cursor = dbapi_connection.cursor()
        try:
            sql, parameters = self._before(conn, cursor, parameters)
            try:
                cursor.execute(sql, parameters)
                row = cursor.fetchone() if cursor.description else None
            except dialect.loaded_dbapi.Error as exc:
                lost = dialect.is_disconnect(exc, dbapi_connection, cursor)
                if lost:
                    conn.invalidate(exc)
                raise DBAPIError.instance(
                    sql, parameters, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
                ) from exc
            self._after(conn, cursor, sql, parameters)
            return cursor.rowcount, row[0] if row else None
        finally:
            cursor.close()

    def _before(self, conn: Connection, cursor: Any, parameters: Any) -> tuple[str, Any]:  # noqa: ANN401 - driver's
        sql = self.sql
        if conn._has_events or conn.engine._has_events:  # as Connection's own execute asks
            for listener in conn.dispatch.before_cursor_execute:
                sql, parameters = listener(conn, cursor, sql, parameters, None, False)
        return sql, parameters

    def _after(self, conn: Connection, cursor: Any, sql: str, parameters: Any) -> None:  # noqa: ANN401 - driver's
        if conn._has_events or conn.engine._has_events:
            conn.dispatch.after_cursor_execute(conn, cursor, sql, parameters, None, False)
