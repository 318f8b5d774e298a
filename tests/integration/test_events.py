"""GET /v1/events against a real server: order, resume from an id, filters, following, scoping (issue 21)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import pytest

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import REPO


def _last_id(client: corral.Client) -> int:
    last = 0
    for event in client.events():
        last = event.id
    return last


def test_a_sandboxs_life_in_order_and_resumable(client: corral.Client) -> None:
    start = _last_id(client)
    mark = {"events-test": uuid.uuid4().hex}
    sandbox = client.create("busybox", memory_mb=64, labels=mark)
    sandbox.pause()
    sandbox.resume()
    sandbox.kill()
    mine = list(client.events(after_id=start, sandbox_id=sandbox.id))
    assert [e.kind for e in mine] == ["sandbox.running", "sandbox.paused", "sandbox.resumed", "sandbox.ended"]
    assert all(e.edge_id == "e0" and e.sandbox_id == sandbox.id for e in mine)
    assert [e.id for e in mine] == sorted(e.id for e in mine) and mine[0].id > start
    assert mine[-1].detail == {"state": "ended", "reason": "killed", "message": None}
    assert mine[2].detail["paused_s"] >= 0

    resumed = list(client.events(after_id=mine[1].id, sandbox_id=sandbox.id))  # resume from an id: the rest
    assert [e.id for e in resumed] == [e.id for e in mine[2:]]
    by_label = list(client.events(after_id=start, labels=mark))
    assert [e.id for e in by_label] == [e.id for e in mine]
    ended_only = list(client.events(after_id=start, kinds=["sandbox.ended"], labels=mark))
    assert [e.kind for e in ended_only] == ["sandbox.ended"]


def test_following_sees_new_events_as_they_happen(client: corral.Client, server: EmbeddedServer) -> None:
    start = _last_id(client)
    mark = {"events-follow": uuid.uuid4().hex}
    seen: list[corral.Event] = []
    done = threading.Event()

    def follow() -> None:
        with server.client() as follower:
            for event in follower.events(after_id=start, follow=True, labels=mark):
                seen.append(event)
                if event.kind == "sandbox.ended":
                    done.set()
                    return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    sandbox = client.create("busybox", memory_mb=64, labels=mark)
    sandbox.kill()
    assert done.wait(30), [e.kind for e in seen]
    thread.join(10)
    assert [e.kind for e in seen] == ["sandbox.running", "sandbox.ended"]


def test_audit_findings_and_nodes_are_in_the_stream(client: corral.Client) -> None:
    nodes = list(client.events(kinds=["node.up"]))
    assert any(e.edge_id == "e0" for e in nodes)  # the embedded node's first heartbeat
    start = _last_id(client)
    with client.create("busybox", memory_mb=64) as sandbox:
        result = sandbox.exec("sleep 5", timeout_s=0.5)
        assert result.timed_out
        findings = [e for e in client.events(after_id=start, sandbox_id=sandbox.id) if e.kind == "audit"]
    assert findings and findings[0].detail["kind"] == "timeout"
    assert {"audit_id", "severity", "detail"} <= findings[0].detail.keys()


def test_a_job_token_sees_its_own_jobs_sandboxes_only(client: corral.Client, server: EmbeddedServer) -> None:
    start = _last_id(client)
    job = f"events-{uuid.uuid4().hex[:8]}"
    token = client.issue_job_token(job)
    try:
        with client.create("busybox", memory_mb=64, labels={"job": job}) as own:
            pass
        with client.create("busybox", memory_mb=64, labels={"job": "someone-else"}):
            pass
        with corral.Client(server.url, token) as scoped:
            events = list(scoped.events(after_id=start))
            assert events and {e.sandbox_id for e in events} == {own.id}
            assert not list(scoped.events(kinds=["node.up"]))
    finally:
        client.revoke_job_tokens(job)


def test_bad_filters_are_refused_clearly(client: corral.Client) -> None:
    with pytest.raises(corral.InvalidRequest, match="unknown event kind 'sandbox.exploded'"):
        list(client.events(kinds=["sandbox.exploded"]))


def test_cli_events(server: EmbeddedServer, client: corral.Client) -> None:
    start = _last_id(client)
    with client.create("busybox", memory_mb=64, labels={"events-cli": "1"}) as sandbox:
        pass
    listed = subprocess.run(
        [sys.executable, "-m", "corral.cli.main", "events", "--after", str(start), "--sandbox", sandbox.id, "--json"],
        env=server.env(), cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    kinds = [json.loads(line)["kind"] for line in listed.stdout.splitlines()]
    assert kinds == ["sandbox.running", "sandbox.ended"]
    table = subprocess.run(
        [sys.executable, "-m", "corral.cli.main", "events", "--after", str(start), "--label", "events-cli=1"],
        env=server.env(), cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "sandbox.running" in table.stdout and sandbox.id in table.stdout and "killed" in table.stdout
