"""A front for a real registry in tests: what docker-registry alone does not do here (Bearer tokens,
redirects to blob storage, broken connections, injected failures), and the certificates of a test CA for a
registry served over https. The registry itself: corral/bench/registry.py."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from corral.bench.registry import Registry, ServerCertificate

_CERT_DAYS = "2"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA (P-256): its certificate and key, ``<name>.pem`` and ``<name>.key`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", _CERT_DAYS, "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)  # fmt: skip
    return directory / f"{name}.pem", directory / f"{name}.key"


def server_certificate(directory: Path, ca: tuple[Path, Path]) -> ServerCertificate:
    """A certificate for 127.0.0.1 and localhost, signed by ``ca`` (certificate, key)."""
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", "server.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-set_serial", "2",
             "-days", _CERT_DAYS, "-extfile", "server.ext", "-out", "server.pem", cwd=directory)  # fmt: skip
    return ServerCertificate(certificate=directory / "server.pem", key=directory / "server.key",
                             ca_certificate=ca[0])  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """An answer the front gives instead of the registry's: ``status`` (with ``retry_after`` as the Retry-After
    header), or, with no status, a connection closed before any answer."""

    status: int | None = None
    retry_after: str | None = None


class RegistryFront:
    """A small HTTP server on loopback in front of a real registry, for what docker-registry alone does not do
    here: ``bearer`` answers with a Bearer challenge and runs the token endpoint (``/token``, which wants
    ``user:password`` as Basic auth); ``redirect`` sends blob GETs to ``/storage/...`` (as registries hand blobs
    to object storage); ``cut_after_bytes`` breaks the first response of each blob there after that many bytes,
    so the client must resume with Range. ``ranges`` records the Range headers the storage side got.

    ``inject(path_part, faults)`` makes the next requests whose path contains ``path_part`` (``/manifests/``,
    ``/blobs/``, ``/token``) get those faults, one each, before the requests after them pass; ``requests``
    records (monotonic time, path, what was answered) of every request, faults included."""

    TOKEN = "corral-test-token"

    def __init__(self, registry: Registry, *, bearer: tuple[str, str] | None = None, redirect: bool = False,
                 cut_after_bytes: int | None = None) -> None:  # fmt: skip
        self.registry = registry
        self.bearer = bearer
        self.redirect = redirect
        self.cut_after_bytes = cut_after_bytes
        self.ranges: list[str | None] = []
        self.token_requests = 0
        self.requests: list[tuple[float, str, int | None]] = []
        self._faults: dict[str, list[Fault]] = {}
        self._faults_lock = threading.Lock()
        self._cut: set[str] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def inject(self, path_part: str, faults: Iterable[Fault]) -> None:
        with self._faults_lock:
            self._faults.setdefault(path_part, []).extend(faults)

    def attempts(self, path_part: str) -> list[int | None]:
        """What was answered to each request whose path contains ``path_part``: a status, or None (cut off)."""
        return [status for _, path, status in self.requests if path_part in path]

    def _fault(self, path: str) -> Fault | None:
        with self._faults_lock:
            for path_part, faults in self._faults.items():
                if path_part in path and faults:
                    return faults.pop(0)
        return None

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
                fault = front._fault(self.path)
                if fault is not None:
                    if fault.status is None:
                        front.requests.append((time.monotonic(), self.path, None))
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                    else:
                        retry_after = {"Retry-After": fault.retry_after} if fault.retry_after else {}
                        self._reply(fault.status, b'{"errors": [{"code": "INJECTED"}]}', retry_after)
                elif self.path.startswith("/token"):
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
                front.requests.append((time.monotonic(), self.path, status))
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
