"""The app's routes found from one table, tried in the order FastAPI's router tries them.

Why: FastAPI 0.163 finds a request's route by asking each included router in turn, each router each of its
routes, saving and restoring scope keys around every try, and then matching again inside the router it picked:
83 us of a create (POST /v1/sandboxes) and 194 us of an E2B command (/process.Process/Start, the 90th of 107
routes) went to that before a line of the endpoint ran, and as much again to match once more. Here every route of
an included router is one row, and a request is tried, in the router's order, against the rows its path's first
segment can match, each with the route's own path regex (8 and 4 us for those two); the route found is handled by
FastAPI itself (``route.handle``: its dependencies, validation and response), inside the app's exception
middleware, as the router would. A request the table cannot answer the same way goes on to FastAPI's router: no
route matched both path and method (a 404, 405 or slash redirect), a mount, a router included with a prefix,
dependencies or a response class of its own, or any other route matched first, the app is served under a root
path, FastAPI's telemetry is on, or the app has dependency overrides (a test's), which only the router's copies of
the routes apply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.datastructures import DefaultPlaceholder
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["RouteTable", "install_route_table"]


@dataclass(frozen=True, slots=True)
class _Row:
    """A route the table hands requests to (an APIRoute) or any other route, which stops the table's search when
    it matches."""

    route: BaseRoute
    path_regex: re.Pattern[str] | None  # a route's own, to pass over the rows a path cannot match at no more cost


def _rows(routes: Sequence[BaseRoute]) -> list[_Row]:
    """The app's routes in the router's order, each included router's routes in place of the router."""
    rows: list[_Row] = []
    for route in routes:
        included = _plainly_included(route)
        if included is not None:
            rows.extend(_Row(each, each.path_regex) for each in included)
        else:
            rows.append(_Row(route, getattr(route, "path_regex", None)))
    return rows


def _plainly_included(route: BaseRoute) -> list[APIRoute] | None:
    """The routes of an included router whose routes the router serves as they were declared (nothing set at the
    include that changes how a request is handled: no prefix, no dependencies, the default response class and
    content-type check; no router inside), or None: that router stays one opaque row."""
    router = getattr(route, "original_router", None)
    context = getattr(route, "include_context", None)
    if router is None or context is None or context.prefix or context.dependencies:
        return None
    if not _default(context.default_response_class, JSONResponse) or not _default(context.strict_content_type, True):
        return None
    routes = list(router.routes)
    return routes if all(isinstance(each, APIRoute) for each in routes) else None


def _default(value: object, default: object) -> bool:
    """``value`` is FastAPI's default: left unset (a placeholder holding it) or set to it."""
    return (value.value if isinstance(value, DefaultPlaceholder) else value) == default


def _first_segment(route: BaseRoute) -> str | None:
    """The literal first segment of the route's path ("v1" of /v1/sandboxes, "" of /), or None when the route may
    match a path that begins otherwise (a parameter there, or no path: a host route, a nested router)."""
    path = getattr(route, "path", None)
    if not isinstance(path, str) or not path.startswith("/"):
        return None
    segment = path.split("/", 2)[1]
    return None if "{" in segment else segment


class RouteTable:
    """ASGI app in place of the router's own dispatch: a request is matched against the table's rows and handed
    to its route, or, when the table cannot answer it as the router would, to the router."""

    def __init__(self, router_app: ASGIApp, app: FastAPI) -> None:
        self.router_app = router_app
        self.app = app
        self._rows: list[_Row] | None = None
        self._by_segment: dict[str, list[_Row]] = {}
        self._any_segment: list[_Row] = []

    def rows(self) -> list[_Row]:
        """Built on the first request: by then every route of the app is declared."""
        if self._rows is None:
            rows = _rows(self.app.router.routes)
            firsts = [_first_segment(row.route) for row in rows]
            self._by_segment = {
                segment: [row for row, first in zip(rows, firsts, strict=True) if first in (segment, None)]
                for segment in set(firsts)
                if segment is not None
            }
            self._any_segment = [row for row, first in zip(rows, firsts, strict=True) if first is None]
            self._rows = rows
        return self._rows

    def rows_for(self, path: str) -> list[_Row]:
        """The rows whose path can match ``path``, in the router's order: those that begin with its first segment
        and those whose first segment is not a literal (an E2B command's is the 90th of 115 rows)."""
        self.rows()
        segment = path.split("/", 2)[1] if path.startswith("/") else None
        return self._any_segment if segment is None else self._by_segment.get(segment, self._any_segment)

    def route_for(self, scope: Scope) -> tuple[APIRoute, Scope] | None:
        """The route the router would hand ``scope`` to and the scope it adds, or None to leave it to the router."""
        if scope["type"] != "http" or scope.get("root_path") or self.app.dependency_overrides:
            return None
        if scope.get("fastapi.telemetry") is not None:
            return None
        path = scope["path"]
        for row in self.rows_for(path):
            if row.path_regex is not None and row.path_regex.match(path) is None:
                continue
            match, child_scope = row.route.matches(scope)
            if match is Match.NONE:
                continue
            if not isinstance(row.route, APIRoute):
                return None
            if match is Match.FULL:
                return row.route, child_scope
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.route_for(scope)
        if found is None:
            await self.router_app(scope, receive, send)
            return
        route, child_scope = found
        scope.setdefault("router", self.app.router)
        scope.update(child_scope)
        await route.handle(scope, receive, send)


def install_route_table(app: FastAPI) -> RouteTable:
    """Put a route table in front of ``app``'s router, inside the app's middleware and exception handlers."""
    table = RouteTable(app.router.middleware_stack, app)
    app.router.middleware_stack = table
    return table
