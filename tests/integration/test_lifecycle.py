"""RL lifecycle: pause with memory reclaimed, transparent resume, idle pause, fork, job-wide actions."""

from __future__ import annotations

import time

import pytest

import corral
from corral.embedded import EmbeddedServer

# 100 MB of anonymous memory (touched, not zero pages) plus 50 MB of page cache. The exec returns once the
# holder has its memory: a fixed sleep was too short for a loaded CI machine (113 MiB seen instead of > 150).
HOLD_MEMORY = (
    "head -c 50000000 /dev/urandom > /tmp/x; "
    'python3 -c \'import os, time; b=bytearray(os.urandom(100<<20)); open("/tmp/held", "w").close(); '
    "time.sleep(3600)' & "
    "while [ ! -e /tmp/held ]; do sleep 0.05; done"
)


def _counter_value(sandbox: corral.Sandbox) -> int:
    return int(sandbox.files.read_text("/tmp/count").split()[-1])


def test_pause_freezes_keeps_state_and_any_request_resumes(client: corral.Client) -> None:
    with client.create("busybox", ttl_s=600) as sandbox:
        sandbox.exec("echo kept > /tmp/state")
        sandbox.start(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; mv /tmp/c.tmp /tmp/count; sleep 0.05; done"
        )
        time.sleep(0.3)
        result = sandbox.pause()
        assert result.sandbox.state == corral.SandboxState.PAUSED and result.sandbox.paused_at is not None
        time.sleep(0.5)
        info = client.get(sandbox.id).info
        assert info.state == corral.SandboxState.PAUSED
        before = info.expires_at
        assert sandbox.exec("cat /tmp/state").stdout == "kept\n"  # a request resumes it transparently
        after = client.get(sandbox.id).info
        assert after.state == corral.SandboxState.RUNNING and after.paused_at is None
        assert before is not None and after.expires_at is not None and after.expires_at >= before + 0.4
        count = _counter_value(sandbox)
        time.sleep(0.3)
        assert _counter_value(sandbox) > count  # the background loop runs again


def test_paused_processes_do_not_run(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.start(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; mv /tmp/c.tmp /tmp/count; sleep 0.05; done"
        )
        time.sleep(0.3)
        sandbox.pause()
        time.sleep(0.1)
        sandbox.resume()
        first = _counter_value(sandbox)
        sandbox.pause()
        time.sleep(0.6)
        sandbox.resume()
        assert _counter_value(sandbox) - first <= 2  # no progress during the 0.6 s pause


def test_pause_gives_memory_back(client: corral.Client) -> None:
    with client.create("debian-12", memory_mb=512) as sandbox:
        assert sandbox.exec(HOLD_MEMORY, timeout_s=60).exit_code == 0
        result = sandbox.pause(wait_reclaim=True)
        assert result.memory_before_bytes > 150 << 20 and not result.reclaim_pending
        reclaimed = 1 - result.memory_after_bytes / result.memory_before_bytes
        assert reclaimed >= 0.8, result
        assert sandbox.exec("wc -c < /tmp/x").stdout.strip() == "50000000"  # resumed, data intact
        assert "python3" in sandbox.exec("cat /proc/[0-9]*/comm").stdout  # the memory holder survived


def test_pause_returns_once_frozen_and_resume_stops_the_reclaim(client: corral.Client) -> None:
    with client.create("debian-12", memory_mb=512) as sandbox:
        assert sandbox.exec(HOLD_MEMORY, timeout_s=60).exit_code == 0
        result = sandbox.pause()
        assert result.reclaim_pending and result.duration_ms < 1000
        started = time.monotonic()
        sandbox.resume()  # while the reclaim may still run: it stops after its current chunk
        assert time.monotonic() - started < 2
        assert sandbox.exec("wc -c < /tmp/x").stdout.strip() == "50000000"


def test_idle_sandboxes_pause_themselves(client: corral.Client) -> None:
    with client.create("busybox", idle_pause_s=0.5) as sandbox:
        deadline = time.monotonic() + 10
        while client.get(sandbox.id).info.state != corral.SandboxState.PAUSED:
            assert time.monotonic() < deadline, "the idle sandbox was not paused"
            time.sleep(0.1)
        assert sandbox.exec("echo awake").stdout == "awake\n"
        assert client.get(sandbox.id).info.state == corral.SandboxState.RUNNING


def test_busy_sandbox_is_not_paused_for_idleness(client: corral.Client) -> None:
    with client.create("busybox", idle_pause_s=0.3) as sandbox:
        command = sandbox.start("sleep 2; echo done")
        time.sleep(1.5)
        assert client.get(sandbox.id).info.state == corral.SandboxState.RUNNING
        assert sandbox.command(command.command_id, wait_s=5).result.stdout == "done\n"


def test_fork_branches_the_filesystem(client: corral.Client) -> None:
    with client.create("busybox", labels={"job": "fork-test"}, env={"STEP": "k"}) as parent:
        parent.exec("echo step-k > /state")
        children = parent.fork(3, labels={"branch": "yes"})
        try:
            assert len({child.id for child in children}) == 3
            for index, child in enumerate(children):
                assert child.exec("cat /state; echo $STEP").stdout == "step-k\nk\n"
                child.exec(f"echo child-{index} > /state")
                assert child.info.labels == {"job": "fork-test", "branch": "yes", "corral.forked_from": parent.id}
            assert parent.exec("cat /state").stdout == "step-k\n"  # branches do not touch the parent
        finally:
            for child in children:
                child.kill()


def test_job_wide_actions_by_label(client: corral.Client) -> None:
    job = {"job": "bulk-test"}
    sandboxes = [client.create("busybox", labels={**job, "rollout": str(i)}) for i in range(3)]
    other = client.create("busybox", labels={"job": "someone-else"})
    try:
        paused = client.bulk(job, "pause")
        assert paused.matched == 3 and sorted(paused.done) == sorted(s.id for s in sandboxes) and not paused.failed
        assert {s.state for s in client.list(labels=job)} == {corral.SandboxState.PAUSED}
        assert client.get(other.id).info.state == corral.SandboxState.RUNNING
        assert client.bulk(job, "resume").matched == 3
        assert {s.state for s in client.list(labels=job)} == {corral.SandboxState.RUNNING}
        client.bulk(job, "set_ttl", ttl_s=5000)
        assert all(s.expires_at and s.expires_at > time.time() + 4000 for s in client.list(labels=job))
        assert client.bulk({**job, "rollout": "1"}, "kill").done == [sandboxes[1].id]
        assert client.bulk(job, "kill").matched == 2
        assert client.list(labels=job) == []
        with pytest.raises(corral.InvalidRequest):
            client.bulk({}, "kill")
    finally:
        other.kill()


def test_paused_sandbox_survives_a_restart(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client:
        sandbox = client.create("busybox")
        sandbox.exec("echo before > /state")
        sandbox.pause()
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        assert client.get(sandbox.id).info.state == corral.SandboxState.PAUSED
        handle = client.connect(sandbox)
        assert handle.exec("cat /state").stdout == "before\n"
        assert client.get(sandbox.id).info.state == corral.SandboxState.RUNNING


def test_job_token_reaches_only_its_job(client: corral.Client, server: EmbeddedServer) -> None:
    token = client.issue_job_token("trainer-7")
    outsider = client.create("busybox", labels={"job": "other"})
    try:
        with corral.Client(server.url, token) as trainer:
            mine = trainer.create("busybox", labels={"rollout": "0"})
            assert mine.info.labels == {"rollout": "0", "job": "trainer-7"}
            assert [s.id for s in trainer.list()] == [mine.id]  # only its job's sandboxes
            assert mine.exec("echo mine").stdout == "mine\n"
            with pytest.raises(corral.PermissionDenied):
                trainer.get(outsider.id)
            with pytest.raises(corral.PermissionDenied):
                trainer.connect(outsider).exec("true")
            with pytest.raises(corral.PermissionDenied):
                trainer.create("busybox", labels={"job": "other"})
            with pytest.raises(corral.PermissionDenied):
                trainer.images.tag("mine", source="busybox")
            assert "busybox:latest" in {image.name for image in trainer.images.list()}  # reading images is fine
            assert trainer.bulk({}, "pause").matched == 1  # the selector is narrowed to its own job
            children = mine.fork(1)
            assert children[0].info.labels["job"] == "trainer-7"
            trainer.bulk({}, "kill")
        assert client.revoke_job_tokens("trainer-7") == 1
        with pytest.raises(corral.AuthenticationError):
            corral.Client(server.url, token).list()
    finally:
        outsider.kill()


def _swap_cached_kb() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("SwapCached:"):
            return int(line.split()[1])
    return 0


def test_resume_prefetches_swapped_memory(client: corral.Client) -> None:
    """The memory holder sleeps and never touches its pages: only the prefetch reads them back from swap."""
    with client.create("debian-12", memory_mb=512) as sandbox:
        assert sandbox.exec(HOLD_MEMORY, timeout_s=60).exit_code == 0
        sandbox.pause(wait_reclaim=True)
        before = _swap_cached_kb()
        sandbox.resume()
        deadline = time.monotonic() + 10
        while _swap_cached_kb() - before < 50_000:  # kB read back into memory (swap cache) ahead of any touch
            assert time.monotonic() < deadline, "the swapped-out memory was not prefetched after resume"
            time.sleep(0.2)


def test_clean_shutdown_sends_term_then_ends_the_container(client: corral.Client) -> None:
    sb = client.create("busybox", ttl_s=300)
    sb.start("trap 'exit 0' TERM; while :; do sleep 0.1; done")
    info = sb.shutdown(timeout_s=20)
    assert (info.state, info.end_reason, info.status_message) == ("ended", "shutdown", "stopped cleanly")
    stubborn = client.create("busybox", ttl_s=300)
    stubborn.start("trap '' TERM; while :; do sleep 0.1; done")
    info = stubborn.shutdown(timeout_s=1)
    assert (info.end_reason, info.status_message) == ("shutdown", "still running after 1s: killed")


def test_clean_shutdown_of_a_sandbox_readopted_after_a_restart(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client:
        sandbox = client.create("busybox", ttl_s=300)
        sandbox.start("trap 'exit 0' TERM; while :; do sleep 0.1; done")
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        info = client.connect(sandbox).shutdown(timeout_s=20)  # the re-attached agent outlives the SIGTERM
        assert (info.state, info.end_reason, info.status_message) == ("ended", "shutdown", "stopped cleanly")
