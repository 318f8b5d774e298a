"""The operations layer through the real server: every route that changes a sandbox leaves a step in its
trajectory, and a resent step id is answered from the log for lifecycle steps and stdin too."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable

import httpx

import corral

MUTATING = {"post", "put", "delete", "patch"}
SANDBOX_PATH = "/v1/sandboxes/{sandbox_id}"

# Routes under a sandbox that change nothing in it, or are logged where their backend runs.
NOT_STEPS = {
    ("post", "/v1/sandboxes/{sandbox_id}/grade"): "reads it: the grading runs in a sandbox of its own",
    ("post", "/v1/sandboxes/{sandbox_id}/trajectory/replay"): "reads its log: the steps run in a new sandbox",
    ("post", "/v1/sandboxes/{sandbox_id}/checkpoints"): "VMs and gVisor: test_vm checks the log's marks",
    ("post", "/v1/sandboxes/{sandbox_id}/checkpoints/{checkpoint_id}/restore"): "as checkpoints",
}


def _tar() -> bytes:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo("t.txt")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"t"))
    return archive.getvalue()


def test_every_route_that_changes_a_sandbox_is_a_step_of_its_trajectory(client: corral.Client) -> None:
    """The OpenAPI document's mutating routes under a sandbox, each called once: each leaves a step of its kind.
    A new route that bypasses the operations layer, or that this test does not know, fails here."""
    document = httpx.get(f"{client.url}/openapi.json", timeout=30).json()
    routes = {
        (method, path)
        for path, methods in document["paths"].items()
        if path.startswith(SANDBOX_PATH)
        for method in methods
        if method in MUTATING
    }
    command: dict[str, str] = {}
    calls: dict[tuple[str, str], tuple[str, Callable[[corral.Sandbox], object]]] = {
        ("post", SANDBOX_PATH + "/exec"): ("exec", lambda s: s.exec("true")),
        ("post", SANDBOX_PATH + "/exec/stream"): ("exec_stream", lambda s: list(s.exec_stream("true"))),
        ("post", SANDBOX_PATH + "/commands"): (
            "start",
            lambda s: command.update(id=s.start("cat", pty=(24, 80)).command_id),
        ),
        ("post", SANDBOX_PATH + "/commands/{command_id}/stdin"): ("stdin", lambda s: s.send_stdin(command["id"], "x")),
        ("post", SANDBOX_PATH + "/commands/{command_id}/resize"): (
            "resize",
            lambda s: s.resize(command["id"], 30, 100),
        ),
        ("post", SANDBOX_PATH + "/commands/{command_id}/signal"): ("signal", lambda s: s.signal(command["id"], 9)),
        ("put", SANDBOX_PATH + "/files/content"): ("write_file", lambda s: s.files.write("/w", "w")),
        ("post", SANDBOX_PATH + "/files/mkdir"): ("mkdir", lambda s: s.files.mkdir("/d")),
        ("post", SANDBOX_PATH + "/files/rename"): ("rename", lambda s: s.files.rename("/w", "/d/w")),
        ("delete", SANDBOX_PATH + "/files"): ("remove", lambda s: s.files.remove("/d", recursive=True)),
        ("put", SANDBOX_PATH + "/files/tar"): ("upload_tar", lambda s: s.files.upload_tar("/", _tar())),
        ("post", SANDBOX_PATH + "/ttl"): ("set_ttl", lambda s: s.set_ttl(600)),
        ("post", SANDBOX_PATH + "/pause"): ("pause", lambda s: s.pause()),
        ("post", SANDBOX_PATH + "/resume"): ("resume", lambda s: s.resume()),
        ("put", SANDBOX_PATH + "/network"): ("set_network", lambda s: s.set_network([])),
        ("post", SANDBOX_PATH + "/snapshot"): ("snapshot", lambda s: s.snapshot()),
        ("post", SANDBOX_PATH + "/fork"): ("fork", lambda s: [child.kill() for child in s.fork(1)]),
        ("post", SANDBOX_PATH + "/shutdown"): ("shutdown", lambda s: s.shutdown(timeout_s=5)),
        ("delete", SANDBOX_PATH): ("kill", lambda s: s.kill()),
    }  # in this order: shutdown ends the sandbox; kill is sent to another
    assert routes == set(calls) | set(NOT_STEPS), "a route that changes a sandbox must go through Operations"
    sandbox, other = client.create("busybox"), client.create("busybox")
    for route, (kind, call) in calls.items():
        target = other if route == ("delete", SANDBOX_PATH) else sandbox
        call(target)
        last = target.trajectory()[-1]
        assert last.kind == kind, f"{route}: the last step is {last.kind}, not {kind}"
        assert last.state == "done" and last.result is not None and "error" not in last.result, last
    kinds = [kind for route, (kind, _) in calls.items() if route != ("delete", SANDBOX_PATH)]
    assert [step.kind for step in sandbox.trajectory()] == kinds  # one step each, in order


def test_a_resent_stdin_or_fork_is_answered_from_the_log(client: corral.Client) -> None:
    """A trainer restarted after preemption sends its last steps again: stdin is not written twice, a fork
    makes no second set of children."""
    with client.create("busybox", labels={"test": "resent-fork"}) as sandbox:
        command = sandbox.start("cat")
        sandbox.send_stdin(command.command_id, "once\n", step_id="in-1")
        sandbox.send_stdin(command.command_id, "once\n", step_id="in-1")
        sandbox.send_stdin(command.command_id, "")  # closes stdin: cat ends
        assert sandbox.command(command.command_id, wait_s=30).result.stdout == "once\n"

        first = sandbox.fork(2, labels={"fork": "f1"}, step_id="fork-1")
        again = sandbox.fork(2, labels={"fork": "f1"}, step_id="fork-1")
        try:
            assert [child.id for child in again] == [child.id for child in first]
            assert len(client.list(labels={"fork": "f1"})) == 2
        finally:
            for child in first:
                child.kill()
        paused = sandbox.pause(step_id="p-1")
        assert sandbox.pause(step_id="p-1") == paused  # the logged answer, to its timing: not paused again
        sandbox.resume(step_id="r-1")
        kinds = [(step.kind, step.step_id) for step in sandbox.trajectory() if not step.step_id.startswith("auto-")]
        assert kinds == [("stdin", "in-1"), ("fork", "fork-1"), ("pause", "p-1"), ("resume", "r-1")]


def test_bulk_actions_are_steps_of_each_sandbox(client: corral.Client) -> None:
    with (
        client.create("busybox", labels={"test": "bulk-ops"}) as a,
        client.create("busybox", labels={"test": "bulk-ops"}),
    ):
        result = client.bulk({"test": "bulk-ops"}, "pause")
        assert len(result.done) == 2
        assert [step.kind for step in a.trajectory()] == ["pause"]
        client.bulk({"test": "bulk-ops"}, "kill")
        assert [step.kind for step in a.trajectory()] == ["pause", "kill"]
