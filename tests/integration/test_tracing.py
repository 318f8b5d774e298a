"""OpenTelemetry export (issue 21): a server with CORRAL_OTEL_TRACES on sends its create and exec spans to an
OTLP/HTTP collector, here a real one on loopback that decodes what it receives with opentelemetry-proto."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from corral.embedded import EmbeddedServer
from corral.sdk import InvalidRequest


@dataclass
class Collector:
    """What the receiver got: every span, with its resource's service name."""

    url: str
    spans: list[Any] = field(default_factory=list)
    services: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def named(self, name: str) -> list[Any]:
        with self.lock:
            return [span for span in self.spans if span.name == name]


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    received = Collector(url="")

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            request = ExportTraceServiceRequest.FromString(body)
            with received.lock:
                for resource_spans in request.resource_spans:
                    attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    received.services.add(attributes.get("service.name", ""))
                    for scope_spans in resource_spans.scope_spans:
                        received.spans.extend(scope_spans.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    received.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield received
    finally:
        httpd.shutdown()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def traced_server(
    tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str], collector: Collector
) -> Iterator[EmbeddedServer]:
    env = {**test_env, "CORRAL_OTEL_TRACES": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
           "OTEL_SERVICE_NAME": "corral-under-test", "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    server = EmbeddedServer(tmp_path_factory.mktemp("traced-server"), env=env)
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


def _attributes(span: Any) -> dict[str, Any]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def _wait_for(collector: Collector, names: list[str], timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {name: collector.named(name) for name in names}
        if all(found.values()):
            return {name: spans[-1] for name, spans in found.items()}
        time.sleep(0.1)
    with collector.lock:
        raise AssertionError(f"spans missing after {timeout_s}s; got {sorted({s.name for s in collector.spans})}")


def test_create_and_exec_spans_reach_the_collector(traced_server: EmbeddedServer, collector: Collector) -> None:
    with traced_server.client() as client:
        sandbox = client.create("busybox", memory_mb=64)
        try:
            assert sandbox.exec("echo traced").stdout == "traced\n"
        finally:
            sandbox.kill()
    create = ["corral.sandbox.create", "corral.sandbox.create.image", "corral.sandbox.create.placement",
              "corral.sandbox.create.start", "corral.edge.admission", "corral.edge.backend_start"]  # fmt: skip
    exec_ = ["corral.sandbox.exec", "corral.edge.exec", "corral.agent.command"]
    spans = _wait_for(collector, create + exec_)
    assert collector.services == {"corral-under-test"}

    def parent(name: str) -> Any:
        found = [s for s in collector.spans if s.span_id == spans[name].parent_span_id]
        assert len(found) == 1, f"{name} has no parent among the received spans"
        return found[0].name

    root = spans["corral.sandbox.create"]
    assert root.parent_span_id == b"", "the create span is a trace's root"
    assert {parent(name) for name in create[1:4]} == {"corral.sandbox.create"}
    assert parent("corral.edge.admission") == parent("corral.edge.backend_start") == "corral.sandbox.create.start"
    assert {spans[name].trace_id for name in create} == {root.trace_id}
    assert _attributes(root) == {"corral.backend": "container", "corral.sandbox_id": sandbox.id,
                                 "corral.edge_id": "e0", "corral.outcome": "ok"}  # fmt: skip
    started = _attributes(spans["corral.edge.backend_start"])
    assert started["corral.sandbox_id"] == sandbox.id and started["corral.backend"] == "container"
    assert _attributes(spans["corral.sandbox.create.placement"])["corral.edge_id"] == "e0"
    phases = [spans[name] for name in create[1:4]]  # image, then placement, then start, inside the create
    assert root.start_time_unix_nano <= phases[0].start_time_unix_nano
    assert [p.start_time_unix_nano for p in phases] == sorted(p.start_time_unix_nano for p in phases)
    assert phases[2].end_time_unix_nano <= root.end_time_unix_nano

    assert spans["corral.sandbox.exec"].parent_span_id == b"", "an exec request is a trace of its own"
    assert parent("corral.edge.exec") == "corral.sandbox.exec"
    assert parent("corral.agent.command") == "corral.edge.exec"
    exec_attributes = {"corral.sandbox_id": sandbox.id, "corral.edge_id": "e0", "corral.backend": "container",
                       "corral.outcome": "ok"}  # fmt: skip
    assert _attributes(spans["corral.sandbox.exec"]) == exec_attributes
    assert _attributes(spans["corral.agent.command"])["corral.exit_code"] == 0
    assert _attributes(spans["corral.edge.exec"])["corral.backend"] == "container"


def test_a_refused_create_ends_its_span_with_the_error_code(
    traced_server: EmbeddedServer, collector: Collector
) -> None:
    with traced_server.client() as client, pytest.raises(InvalidRequest, match="no node has labels zone=nowhere"):
        client.create("busybox", memory_mb=64, node_selector={"zone": "nowhere"})
    deadline = time.monotonic() + 20.0
    while not (refused := [s for s in collector.named("corral.sandbox.create") if "corral.sandbox_id" not in
                           _attributes(s)]):  # fmt: skip
        assert time.monotonic() < deadline, "no span of the refused create arrived"
        time.sleep(0.1)
    assert _attributes(refused[0]) == {"corral.backend": "container", "corral.outcome": "invalid_request"}
    assert refused[0].status.code == refused[0].status.STATUS_CODE_ERROR
