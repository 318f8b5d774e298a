"""The route table (gateway/route_table.py) hands every request to the route FastAPI's router would pick, or
leaves it to the router: checked for a request at every declared path of the app, with every method, against the
router's own choice."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from starlette.types import Message, Receive, Scope, Send

from corral.gateway.app import create_app
from corral.gateway.route_table import RouteTable, install_route_table

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
PARAMETER = re.compile(r"{(\w+)(:\w+)?}")


def _scope(app: FastAPI, method: str, path: str) -> Scope:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": [],
        "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000), "app": app,
    }  # fmt: skip


def _routers_choice(app: FastAPI, method: str, path: str, monkeypatch: pytest.MonkeyPatch) -> APIRoute | None:
    """The route FastAPI's own router hands the request to (its handle recorded, not run), or None."""
    chosen: list[APIRoute] = []

    async def record(route: APIRoute, scope: Scope, receive: Receive, send: Send) -> None:
        chosen.append(route)

    messages: list[Message] = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Message:  # the body, then a hang-up (a file response waits for one)
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        return None

    with monkeypatch.context() as patch:
        patch.setattr(APIRoute, "handle", record)
        try:
            asyncio.run(app.router.app(_scope(app, method, path), receive, send))
        except Exception:  # a 404/405 raised for the exception middleware: no route chosen
            pass
    return chosen[0] if chosen else None


def _sample_paths(app: FastAPI) -> list[str]:
    """A path for each declared route (its parameters filled in), variants around them and paths no route has."""
    paths = ["/", "/nope", "/v1", "/v1/sandboxes/", "/ui/", "/ui/index.html", "/openapi.json", "/docs"]
    table = app.router.middleware_stack
    assert isinstance(table, RouteTable)
    for row in table.rows():
        route = row.route
        template = getattr(route, "path", None)
        if not template:
            continue
        filled = PARAMETER.sub(lambda m: "sb-e0-1" if m.group(2) is None else "a/b.txt", template)
        paths += [filled, filled + "/", filled + "/extra"]
    return sorted(set(paths))


def test_the_table_picks_the_routers_route_for_every_path_and_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(None, 1 << 20, tmp_path)
    table = app.router.middleware_stack
    assert isinstance(table, RouteTable)
    answered = 0
    for path in _sample_paths(app):
        for method in METHODS:
            found = table.route_for(_scope(app, method, path))
            router = _routers_choice(app, method, path, monkeypatch)
            if found is None:
                continue  # left to the router: right whatever it chooses
            assert found[0] is router, f"{method} {path}: table {found[0].path}, router {router and router.path}"
            answered += 1
    assert answered > 150  # the table answers the app's routes itself, not just hands them on


def test_the_table_answers_the_hot_paths_with_their_declared_routes(tmp_path: Path) -> None:
    app = create_app(None, 1 << 20, tmp_path)
    table = app.router.middleware_stack
    assert isinstance(table, RouteTable)
    expected = {
        ("POST", "/v1/sandboxes"): ("/v1/sandboxes", {}),
        ("DELETE", "/v1/sandboxes/sb-e0-1"): ("/v1/sandboxes/{sandbox_id}", {"sandbox_id": "sb-e0-1"}),
        ("POST", "/v1/sandboxes/sb-e0-1/pause"): ("/v1/sandboxes/{sandbox_id}/pause", {"sandbox_id": "sb-e0-1"}),
        ("POST", "/sandboxes"): ("/sandboxes", {}),  # E2B's create
        ("POST", "/process.Process/Start"): ("/process.Process/{method}", {"method": "Start"}),  # E2B's command
    }
    for (method, path), (template, params) in expected.items():
        found = table.route_for(_scope(app, method, path))
        assert found is not None and (found[0].path, found[1]["path_params"]) == (template, params), (method, path)
    assert table.route_for(_scope(app, "GET", "/nope")) is None
    assert table.route_for(_scope(app, "GET", "/ui/index.html")) is None  # the dashboard's mount: the router's


def test_what_an_include_or_the_app_changes_about_handling_is_left_to_the_router() -> None:
    app = FastAPI()
    plain, prefixed = APIRouter(), APIRouter()

    async def files(scope: Scope, receive: Receive, send: Send) -> None:
        return None

    app.mount("/things/files", files)  # declared before plain's /things/{thing_id}: it wins /things/files/...

    @plain.get("/{kind}/count")
    async def count(kind: str) -> dict[str, str]:  # its first segment a parameter: a candidate for any path
        return {"count": kind}

    @plain.get("/things/{thing_id:path}")
    async def thing(thing_id: str) -> dict[str, str]:  # /things/files/a too, were it not for the mount
        return {"thing": thing_id}

    @prefixed.get("/things/{thing_id}")
    async def shadowed(thing_id: str) -> dict[str, str]:
        return {"shadowed": thing_id}

    plain_text = APIRouter()

    @plain_text.get("/notes/{note_id}")
    async def note(note_id: str) -> str:
        return note_id

    app.include_router(prefixed, prefix="/v2")
    app.include_router(plain_text, default_response_class=PlainTextResponse)
    app.include_router(plain)
    table = install_route_table(app)
    assert table.route_for(_scope(app, "GET", "/v2/things/7")) is None  # the prefixed router: one opaque row
    assert table.route_for(_scope(app, "GET", "/notes/7")) is None  # its response class set at the include
    assert table.route_for(_scope(app, "GET", "/things/files/a")) is None  # the mount matches first
    found = table.route_for(_scope(app, "GET", "/things/7"))
    assert found is not None and found[0].endpoint is thing and found[1]["path_params"] == {"thing_id": "7"}
    counted = table.route_for(_scope(app, "GET", "/boxes/count"))
    assert counted is not None and counted[0].endpoint is count  # no literal route begins with /boxes
    counted = table.route_for(_scope(app, "GET", "/things/count"))
    assert counted is not None and counted[0].endpoint is count  # declared before /things/{thing_id:path}
    app.dependency_overrides[thing] = lambda: None
    assert table.route_for(_scope(app, "GET", "/things/7")) is None
