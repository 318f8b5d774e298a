"""gVisor (runtime="runsc") sandboxes: the real runsc on the systrap platform, through the real SDK and server.

One module-scoped sandbox serves the read-mostly tests; checkpoint, fork and
restart tests make their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

import corral
from corral.backends.common.host import runtime_dirs_of, runtime_state_root
from corral.embedded import EmbeddedServer
from corral.sdk import NotFound

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh installs it)"),
]


@pytest.fixture(scope="module")
def gvisor(server: EmbeddedServer) -> Iterator[corral.Sandbox]:
    with server.client() as client, client.create("busybox", runtime="runsc", ttl_s=600) as sb:
        yield sb


def _runsc_ids(server: EmbeddedServer) -> list[str]:
    listing = subprocess.run(
        ["runsc", "--root", str(runtime_state_root(server.data_dir, "runsc")), "list", "--quiet"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return listing.stdout.split()


def test_runsc_sandbox_runs_on_gvisors_kernel(gvisor: corral.Sandbox) -> None:
    result = gvisor.exec("uname -r; dmesg | head -1; echo err >&2; exit 3")
    assert result.exit_code == 3 and result.stderr == "err\n"
    release, first_kernel_line = result.stdout.splitlines()
    assert release != os.uname().release  # not the host's kernel
    assert "Starting gVisor" in first_kernel_line
    info = gvisor.refresh()
    assert info.runtime == "runsc" and info.state == "running"


def test_runsc_exec_stdin_env_cwd_and_timeout(gvisor: corral.Sandbox) -> None:
    assert gvisor.exec("cat", stdin=b"piped").stdout == "piped"
    assert gvisor.exec("echo $GREETING; pwd", env={"GREETING": "hi"}, cwd="/tmp").stdout == "hi\n/tmp\n"
    slow = gvisor.exec("sleep 30", timeout_s=0.5)
    assert slow.timed_out


def test_runsc_files_go_through_the_sentry(gvisor: corral.Sandbox) -> None:
    gvisor.files.write("/tmp/dir/note.txt", b"written from the host", mode=0o640)
    assert gvisor.exec("cat /tmp/dir/note.txt; stat -c %a /tmp/dir/note.txt").stdout == "written from the host640\n"
    gvisor.exec("echo made inside > /tmp/dir/inside")
    assert gvisor.files.read("/tmp/dir/inside") == b"made inside\n"
    assert {entry.name for entry in gvisor.files.list("/tmp/dir")} == {"note.txt", "inside"}
    with pytest.raises(NotFound):
        gvisor.files.read("/tmp/dir/missing")


def test_runsc_pause_then_any_request_resumes(gvisor: corral.Sandbox) -> None:
    gvisor.exec("echo before > /tmp/p")
    assert gvisor.pause().sandbox.state == "paused"
    assert gvisor.exec("cat /tmp/p").stdout == "before\n"  # transparent resume
    assert gvisor.refresh().state == "running"


def test_runsc_refuses_a_network_and_crun_refuses_checkpoints(client: corral.Client) -> None:
    with pytest.raises(corral.InvalidRequest, match="loopback only"):
        client.create("busybox", runtime="runsc", network={"allow": []}, ttl_s=60)
    with client.create("busybox", ttl_s=60) as container, pytest.raises(corral.InvalidRequest, match="runsc"):
        container.checkpoint()


def test_runsc_fork_carries_memory_and_a_running_process(client: corral.Client) -> None:
    with client.create("busybox", runtime="runsc", ttl_s=300) as parent:
        parent.exec("echo parent-file > /root/state; sleep 600 >/dev/null 2>&1 & echo $! > /root/pid")
        pid = parent.exec("cat /root/pid").stdout.strip()
        kids = parent.fork(2)
        try:
            for kid in kids:
                assert kid.refresh().runtime == "runsc"
                assert kid.exec("cat /root/state").stdout == "parent-file\n"
                assert kid.exec(f"kill -0 {pid} && echo running").stdout == "running\n"  # the process came along
                assert kid.exec(f"cat /proc/{pid}/cmdline | tr '\\0' ' '").stdout == "sleep 600 "
            kids[0].exec("echo child > /root/state")
            assert parent.exec("cat /root/state").stdout == "parent-file\n"
            assert kids[1].exec("cat /root/state").stdout == "parent-file\n"
            assert parent.exec(f"kill -0 {pid} && echo running").stdout == "running\n"  # the parent kept its own
        finally:
            for kid in kids:
                kid.kill()


def test_runsc_checkpoint_rewinds_the_same_sandbox_and_seeds_forks(client: corral.Client) -> None:
    with client.create("busybox", runtime="runsc", ttl_s=300) as sb:
        sb.exec("echo step-1 > /root/state; sleep 600 >/dev/null 2>&1 & echo $! > /root/pid")
        saved = sb.checkpoint()
        assert saved.sandbox_id == sb.id and saved.size_bytes > 0
        assert [c.id for c in sb.checkpoints()] == [saved.id]
        sb.exec("echo step-2 > /root/state; kill $(cat /root/pid)")
        assert sb.restore(saved.id).state == "running"
        assert sb.exec("cat /root/state").stdout == "step-1\n"  # rewound: files and memory as at the checkpoint
        assert sb.exec("kill -0 $(cat /root/pid) && echo alive").stdout == "alive\n"  # the killed process is back
        sb.exec("echo step-3 > /root/state")
        (child,) = sb.fork(1, checkpoint=saved.id)
        try:
            assert child.exec("cat /root/state").stdout == "step-1\n"
        finally:
            child.kill()
        assert sb.exec("cat /root/state").stdout == "step-3\n"
        with pytest.raises(NotFound, match="no checkpoint"):
            sb.restore("ck-000000000000")


def test_runsc_kill_removes_the_gvisor_sandbox(server: EmbeddedServer, client: corral.Client) -> None:
    sb = client.create("busybox", runtime="runsc", ttl_s=60)
    assert sb.id in _runsc_ids(server)
    sb.kill()
    assert sb.id not in _runsc_ids(server)
    assert not (server.data_dir / "sandboxes" / sb.id).exists()
    assert not (runtime_dirs_of(server.data_dir) / sb.id).exists()


def test_runsc_sandbox_is_readopted_after_a_server_restart(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client:
        sb = client.create("busybox", runtime="runsc", ttl_s=300)
        sb.exec("echo kept > /root/k; sleep 600 >/dev/null 2>&1 & echo $! > /root/pid")
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        again = client.connect(sb)
        assert again.refresh().state == "running"
        assert again.exec("cat /root/k; kill -0 $(cat /root/pid) && echo alive").stdout == "kept\nalive\n"
        again.kill()
    assert sb.id not in _runsc_ids(fresh_server)


def test_runsc_clean_shutdown_sends_term_and_counts_the_sentrys_processes(client: corral.Client) -> None:
    sb = client.create("busybox", runtime="runsc", ttl_s=300)
    sb.start("trap 'exit 0' TERM; while :; do sleep 0.1; done")
    info = sb.shutdown(timeout_s=20)
    assert (info.state, info.end_reason, info.status_message) == ("ended", "shutdown", "stopped cleanly")
