"""A front for a real registry in tests: what docker-registry alone does not do here (Bearer tokens,
redirects to blob storage, broken connections). The registry itself: corral/bench/registry.py."""

from __future__ import annotations

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from corral.bench.registry import Registry


class RegistryFront:
    """A small HTTP server on loopback in front of a real registry, for what docker-registry alone does not do
    here: ``bearer`` answers with a Bearer challenge and runs the token endpoint (``/token``, which wants
    ``user:password`` as Basic auth); ``redirect`` sends blob GETs to ``/storage/...`` (as registries hand blobs
    to object storage); ``cut_after_bytes`` breaks the first response of each blob there after that many bytes,
    so the client must resume with Range. ``ranges`` records the Range headers the storage side got."""

    TOKEN = "corral-test-token"

    def __init__(self, registry: Registry, *, bearer: tuple[str, str] | None = None, redirect: bool = False,
                 cut_after_bytes: int | None = None) -> None:  # fmt: skip
        self.registry = registry
        self.bearer = bearer
        self.redirect = redirect
        self.cut_after_bytes = cut_after_bytes
        self.ranges: list[str | None] = []
        self.token_requests = 0
        self._cut: set[str] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.startswith("/token"):
                    self._token()
                elif front.bearer and self.headers.get("Authorization") != f"Bearer {front.TOKEN}":
                    realm = f"http://{front.address}/token"
                    self._reply(401, b"{}", {"WWW-Authenticate": f'Bearer realm="{realm}",service="corral-test"'})
                elif front.redirect and self.path.startswith("/v2/") and "/blobs/" in self.path:
                    self._reply(307, b"", {"Location": f"http://{front.address}/storage{self.path}"})
                else:
                    self._forward(self.path.removeprefix("/storage"), storage=self.path.startswith("/storage/"))

            def _token(self) -> None:
                front.token_requests += 1
                user, password = front.bearer or ("", "")
                expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
                if self.headers.get("Authorization") != expected:
                    self._reply(401, b'{"details": "bad credentials"}', {})
                else:
                    self._reply(200, json.dumps({"token": front.TOKEN}).encode(), {})

            def _forward(self, path: str, *, storage: bool) -> None:
                headers = {key: value for key, value in self.headers.items() if key.lower() in ("accept", "range")}
                if storage:
                    front.ranges.append(self.headers.get("Range"))
                with httpx.stream("GET", front.registry.url + path, headers=headers, timeout=30) as upstream:
                    body = upstream.read()
                kept = ("content-type", "docker-content-digest", "content-range", "www-authenticate")
                self._reply(upstream.status_code, body, {k: v for k, v in upstream.headers.items() if k in kept},
                            cut=storage and front.cut_after_bytes is not None and path not in front._cut)  # fmt: skip
                if storage:
                    front._cut.add(path)

            def _reply(self, status: int, body: bytes, headers: dict[str, str], *, cut: bool = False) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if cut and front.cut_after_bytes is not None:
                    self.wfile.write(body[: front.cut_after_bytes])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body)

        return Handler
