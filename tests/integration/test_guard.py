"""Adversarial cases: an agent that cheats, inside real sandboxes; the cheat must fail or be contained."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import corral
from corral.api.models import AuditEvent

GRADER = (
    'if [ "$(cat /work/answer)" = "$(cat /hidden/expected)" ]; then echo 1 > /reward; else echo 0 > /reward; fi; '
    "echo graded-by-$(readlink /bin/sh)"
)


@pytest.fixture(scope="module")
def grading_layers(tmp_path_factory: pytest.TempPathFactory, server) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """A hidden layer with the answer, and a trusted-tools layer with a known-good shell."""
    root = tmp_path_factory.mktemp("grading")
    hidden = root / "hidden"
    (hidden / "hidden").mkdir(parents=True)
    (hidden / "hidden" / "expected").write_text("42\n")
    trusted = root / "trusted"
    (trusted / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", trusted / "bin" / "busybox")
    for applet in ("sh", "cat", "echo", "readlink"):
        (trusted / "bin" / applet).symlink_to("busybox")
    with server.client() as client:
        client.images.build("answers", "dir", path=str(hidden), layer_kind="tools")
        client.images.build("trusted-sh", "dir", path=str(trusted), layer_kind="tools")
    return "answers", "trusted-sh"


def test_hidden_answers_are_never_in_the_agents_sandbox(client: corral.Client, grading_layers) -> None:  # type: ignore[no-untyped-def]
    answers, _ = grading_layers
    with client.create("busybox") as agent:
        assert agent.exec("find / -path /proc -prune -o -name expected -print").stdout == ""
        agent.exec("mkdir -p /work && echo 42 > /work/answer")
        graded = agent.grade(GRADER, hidden=[answers], reward_path="/reward")
        assert graded.reward == "1\n"
        assert not agent.files.exists("/hidden/expected")  # grading did not expose them afterwards either


def test_reward_written_by_the_agent_is_ignored(client: corral.Client, grading_layers) -> None:  # type: ignore[no-untyped-def]
    answers, trusted = grading_layers
    with client.create("busybox") as agent:
        agent.exec("mkdir -p /work && echo 41 > /work/answer && echo 1 > /reward")  # wrong answer, forged reward
        graded = agent.grade(GRADER, hidden=[answers], trusted=[trusted], reward_path="/reward")
        assert graded.reward == "0\n"


def test_a_replaced_shell_is_shadowed_by_the_trusted_one(client: corral.Client, grading_layers) -> None:  # type: ignore[no-untyped-def]
    answers, trusted = grading_layers
    with client.create("busybox") as agent:
        agent.exec("mkdir -p /work && echo 41 > /work/answer")
        # Overwrite the shell the grader would use with one that always reports success.
        agent.exec("rm /bin/sh && printf '#!/bin/busybox ash\\necho 1 > /reward\\n' > /bin/sh && chmod +x /bin/sh")
        graded = agent.grade(GRADER, hidden=[answers], trusted=[trusted], reward_path="/reward")
        assert graded.reward == "0\n" and "graded-by-busybox" in graded.stdout
        assert graded.grader_layers[-1] == client.images.inspect(trusted).layers[0].digest


def test_trusted_base_is_mounted_again_on_top(client: corral.Client) -> None:
    with client.create("busybox") as agent:
        agent.exec("rm /bin/cat && printf '#!/bin/sh\\necho fake\\n' > /bin/cat && chmod +x /bin/cat")
        graded = agent.grade("cat /etc/hostname >/dev/null && echo real-cat", trusted=["busybox"])
        assert graded.stdout == "real-cat\n"
        assert graded.grader_layers[-1].endswith("#trusted")


def test_grader_needs_existing_layers(client: corral.Client) -> None:
    with client.create("busybox") as agent:
        with pytest.raises(corral.NotFound):
            agent.grade("true", hidden=["no-such-answers"])


def _kinds(sandbox: corral.Sandbox) -> dict[str, str]:
    return {event.kind: event.severity for event in sandbox.audit_events()}


def test_replacing_a_system_binary_raises_a_critical_event(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.exec("echo harmless")
        assert "protected_path_modified" not in _kinds(sandbox)
        sandbox.exec("rm /bin/vi && printf '#!/bin/sh\\necho pwned\\n' > /bin/vi && chmod +x /bin/vi")
        events = [e for e in sandbox.audit_events() if e.kind == "protected_path_modified"]
        assert len(events) == 1 and events[0].severity == "critical" and "/bin/vi" in events[0].detail["paths"]
        sandbox.exec("echo again")
        assert len([e for e in sandbox.audit_events() if e.kind == "protected_path_modified"]) == 1  # reported once


def test_editing_protected_task_files_is_reported(client: corral.Client) -> None:
    with client.create("busybox", protected_paths=["/work/tests/"]) as sandbox:
        sandbox.files.write("/work/tests/test_task.py", "assert solve() == 42\n")  # the task's own setup
        sandbox.audit_events()
        sandbox.exec("echo 'assert True' > /work/tests/test_task.py")  # the agent weakens the test
        kinds = _kinds(sandbox)
        assert kinds.get("protected_path_modified") == "critical" and "modifies_tests" in kinds


def test_a_streamed_command_editing_protected_files_is_reported(client: corral.Client) -> None:
    """The findings come with a streamed command's exit too (from the one call to its node), with a step id or
    without (a path is reported the first time it changes)."""
    with client.create("busybox", protected_paths=["/work/tests/"]) as sandbox:
        sandbox.files.write("/work/tests/test_task.py", "assert solve() == 42\n")
        setup = len(sandbox.audit_events())

        def protected_after_setup() -> list[list[str]]:
            found = sandbox.audit_events()[setup:]
            return [e.detail["paths"] for e in found if e.kind == "protected_path_modified"]

        list(sandbox.exec_stream("echo 'assert True' > /work/tests/a.py", step_id="weaken"))
        assert protected_after_setup() == [["/work/tests/a.py"]]
        list(sandbox.exec_stream("echo 'assert True' > /work/tests/b.py"))
        assert protected_after_setup() == [["/work/tests/a.py"], ["/work/tests/b.py"]]
        assert [s.files for s in sandbox.trajectory() if s.step_id == "weaken"] == [["/work/tests/a.py"]]


def test_quota_hits_are_events(client: corral.Client) -> None:
    with client.create("busybox", memory_mb=32, pids_max=32) as sandbox:
        sandbox.exec("tail /dev/zero", timeout_s=30)
        sandbox.exec("yes", timeout_s=0.5, output_cap_bytes=1000)
        sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=2)
        kinds = _kinds(sandbox)
        assert kinds["oom_kill"] == "warning" and kinds["output_capped"] == "info" and kinds["timeout"] == "info"
        assert kinds["pids_limit"] == "warning"


def test_kernel_memory_probe_is_contained_and_flagged(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        result = sandbox.exec(
            "cat /proc/kpagecgroup /proc/kcore 2>&1 | head -c 100 | wc -c; "
            "grep -r x /proc/sys/kernel 2>/dev/null | head -1"
        )
        assert result.exit_code == 0
        assert _kinds(sandbox)["probe_kernel_memory"] == "critical"
        assert sandbox.exec("echo alive").stdout == "alive\n"


def test_audit_stream_follows_new_events(client: corral.Client) -> None:
    last = max([e.id for e in client.audit_events()], default=0)
    with client.create("busybox") as sandbox:
        sandbox.exec("insmod evil.ko; true")
        events = client.audit_events(after_id=last, wait_s=5)
        assert any(e.kind == "privileged_tool" and e.sandbox_id == sandbox.id for e in events)


def test_writable_layer_size_limit(client: corral.Client, server) -> None:  # type: ignore[no-untyped-def]
    with client.create("busybox", disk_mb=16) as sandbox:
        assert sandbox.info.disk_mb == 16
        filled = sandbox.exec("dd if=/dev/zero of=/big bs=1M count=64 2>&1; echo rc=$?")
        assert "Disk quota exceeded" in filled.stdout and not filled.stdout.strip().endswith("rc=0")
        assert _kinds(sandbox).get("disk_full") == "warning"
        sandbox.exec("rm /big")
        assert sandbox.exec("echo fine > /f && cat /f").stdout == "fine\n"  # usable again once space is freed
        snapshot = sandbox.snapshot()  # the size-limited layer packs like any other
        assert snapshot.diff.size_bytes > 0
        layer = server.data_dir / "writable" / sandbox.id  # its subvolume of the node's quota pool
        assert (Path(f"/proc/{server.process.pid}/root") / layer.relative_to("/") / "upper" / "f").exists()
    assert not (Path(f"/proc/{server.process.pid}/root") / layer.relative_to("/")).exists()  # gone with it


def test_disk_limit_survives_a_restart(fresh_server) -> None:  # type: ignore[no-untyped-def]
    with fresh_server.client() as client:
        sandbox = client.create("busybox", disk_mb=16)
        sandbox.exec("echo kept > /kept")
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        handle = client.connect(sandbox)
        assert handle.exec("cat /kept").stdout == "kept\n"
        assert handle.snapshot().diff.size_bytes > 0  # the edge sees the writable layer again
        handle.kill()


def _events(
    sandbox: corral.Sandbox, kind: str, wait_s: float = 10.0, key: str | None = None, after_id: int = 0
) -> list[AuditEvent]:
    """The sandbox's events of one kind (and key), waiting for the first: kernel-reported ones arrive with
    the edge's housekeeping, about once a second."""
    deadline = time.monotonic() + wait_s
    while True:
        events = sandbox.audit_events(after_id=after_id)
        found = [e for e in events if e.kind == kind and (key is None or e.detail["key"] == key)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_refused_syscalls_are_events(client: corral.Client) -> None:
    last = max([e.id for e in client.audit_events()], default=0)
    with client.create("busybox") as sandbox, client.create("busybox") as bystander:
        result = sandbox.exec("unshare -m true; echo rc=$?; mount -t tmpfs none /mnt; echo rc=$?")
        assert result.stdout == "rc=1\nrc=1\n"  # EPERM from seccomp
        unshare = _events(sandbox, "syscall_denied", key="unshare")
        assert unshare and unshare[0].severity == "warning"
        assert unshare[0].detail["first"][0]["comm"] == "unshare"  # named after the process exited
        assert _events(sandbox, "syscall_denied", key="mount")
        assert _events(bystander, "syscall_denied", wait_s=0) == []
        streamed = client.audit_events(after_id=last, wait_s=5)  # the node-wide stream has them too
        assert any(e.kind == "syscall_denied" and e.sandbox_id == sandbox.id for e in streamed)


def test_a_sandbox_looping_on_a_refused_syscall_cannot_flood_the_log(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        loop = sandbox.exec("i=0; while [ $i -lt 1000 ]; do unshare -m true 2>/dev/null; i=$((i+1)); done; echo $i")
        assert loop.stdout == "1000\n"
        time.sleep(4.5)  # two repeat windows (CORRAL_AUDIT_REPEAT_WINDOW_S=2 in tests)
        events = _events(sandbox, "syscall_denied", key="unshare")
        assert 1 <= len(events) <= 8  # first occurrence, then one summary per window
        assert max(e.detail["total"] for e in events) == sum(e.detail["count"] for e in events) == 1000
        assert all(len(e.detail["first"]) <= 5 for e in events)
        assert sandbox.exec("echo alive").stdout == "alive\n"


def test_reading_a_sensitive_path_is_a_critical_event(client: corral.Client) -> None:
    sensitive = ["/work/hidden/", "/etc/answer.txt"]
    with client.create("busybox", sensitive_paths=sensitive) as sandbox, client.create("busybox") as other:
        sandbox.files.write("/work/hidden/expected.txt", "42\n")  # the task's setup; it did not exist at create
        sandbox.files.write("/etc/answer.txt", "42\n")
        assert sandbox.files.read_text("/work/hidden/expected.txt") == "42\n"  # the trainer's own reads don't count
        sandbox.exec("cat /etc/passwd /work/notes 2>/dev/null; ls /work")  # near, but not sensitive
        other.exec("mkdir -p /work/hidden && echo 1 > /work/hidden/expected.txt && cat /work/hidden/expected.txt")
        time.sleep(2.5)
        assert _events(sandbox, "sensitive_path_read", wait_s=0) == []
        assert _events(other, "sensitive_path_read", wait_s=0) == []

        assert sandbox.exec("cat /work/hidden/expected.txt").stdout == "42\n"  # reading is not prevented...
        read = _events(sandbox, "sensitive_path_read", key="/work/hidden/expected.txt")  # ...but it is seen
        assert read and read[0].severity == "critical" and read[0].detail["first"][0]["path"] == read[0].detail["key"]
        sandbox.exec("grep -r 4 /etc/ >/dev/null; ls /work/hidden")
        assert _events(sandbox, "sensitive_path_read", key="/etc/answer.txt")
        assert _events(sandbox, "sensitive_path_read", key="/work/hidden")
        # Moving a file out first does not shake the watch off: the mark follows the file.
        sandbox.exec("mv /etc/answer.txt /work/moved && cat /work/moved >/dev/null")
        assert _events(sandbox, "sensitive_path_read", key="/work/moved")
        # Nor does replacing the directory: it is marked again after each command.
        sandbox.exec("mv /work/hidden /work/old && mkdir /work/hidden && echo 43 > /work/hidden/expected.txt")
        last = sandbox.audit_events()[-1].id
        sandbox.exec("cat /work/hidden/expected.txt")
        assert _events(sandbox, "sensitive_path_read", key="/work/hidden/expected.txt", after_id=last)


def test_kernel_events_still_map_after_a_restart(fresh_server) -> None:  # type: ignore[no-untyped-def]
    with fresh_server.client() as client:
        sandbox = client.create("busybox", sensitive_paths=["/work/hidden/"])
        sandbox.exec("mkdir -p /work/hidden && echo 42 > /work/hidden/expected")
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        handle = client.connect(sandbox)
        handle.exec("unshare -m true; cat /work/hidden/expected")  # run by the agent the new edge attached
        assert _events(handle, "syscall_denied", key="unshare")
        assert _events(handle, "sensitive_path_read", key="/work/hidden/expected")
        handle.kill()


def test_forks_are_watched_like_their_parent(client: corral.Client) -> None:
    with client.create("busybox", sensitive_paths=["/work/hidden/"], protected_paths=["/work/tests/"]) as parent:
        parent.exec("mkdir -p /work/hidden /work/tests && echo 42 > /work/hidden/expected && echo t > /work/tests/t")
        (child,) = parent.fork(1)
        try:
            child.exec("cat /work/hidden/expected; echo weakened > /work/tests/t")
            assert _events(child, "sensitive_path_read", key="/work/hidden/expected")
            assert any(e.kind == "protected_path_modified" for e in child.audit_events())
        finally:
            child.kill()
