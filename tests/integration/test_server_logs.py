"""The server's log lines: JSON when asked, the sandbox's id on every line about one (issue 21)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.embedded import EmbeddedServer


@pytest.fixture
def json_logging_server(tmp_path: Path, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path / "server", env={**test_env, "CORRAL_LOG_FORMAT": "json"})
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


def test_json_lines_carry_the_sandbox(json_logging_server: EmbeddedServer) -> None:
    with json_logging_server.client() as client:
        sandbox = client.create("busybox", memory_mb=64)
        sandbox.pause()  # logged inside the request, without naming the sandbox: the request's context does
        sandbox.kill()
    lines = [json.loads(line) for line in json_logging_server.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines, json_logging_server.log_path.read_text()[-2000:]
    assert all({"ts", "level", "logger", "message", "sandbox_id", "edge_id"} <= line.keys() for line in lines)
    mine = {line["message"].split(" ")[0]: line for line in lines if line["sandbox_id"] == sandbox.id}
    assert {"created", "paused", "ended:"} <= mine.keys(), [line["message"] for line in lines][-20:]
    assert mine["ended:"]["message"] == "ended: killed"
    assert all(line["edge_id"] == "e0" and line["level"] == "info" for line in mine.values())
