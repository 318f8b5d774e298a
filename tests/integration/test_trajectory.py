"""The trajectory log through the real server: replay on resend, divergence, export, provenance, replay, restarts."""

from __future__ import annotations

import io
import json
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path

import pytest

import corral
from corral.embedded import EmbeddedServer


def test_resent_step_is_answered_from_the_log(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        first = sandbox.exec("echo ran >> /runs; wc -l < /runs", step_id="s1")
        again = sandbox.exec("echo ran >> /runs; wc -l < /runs", step_id="s1")
        assert (first.stdout, first.replayed) == ("1\n", False)
        assert (again.stdout, again.replayed) == ("1\n", True)
        assert sandbox.exec("wc -l < /runs").stdout == "1\n"  # the non-idempotent command did not run twice


def test_divergent_step_is_refused(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.exec("echo a", step_id="s1")
        with pytest.raises(corral.Conflict, match="diverge"):
            sandbox.exec("echo b", step_id="s1")


def test_every_command_and_write_is_logged_in_order(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.exec("true")
        sandbox.files.write("/a.txt", "A", step_id="w1")
        list(sandbox.exec_stream("echo streamed", step_id="s2"))
        sandbox.exec("exit 3", step_id="s3")
        steps = sandbox.trajectory()
        assert [s.seq for s in steps] == [1, 2, 3, 4]
        assert [s.kind for s in steps] == ["exec", "write_file", "exec_stream", "exec"]
        assert steps[0].step_id.startswith("auto-") and steps[1].step_id == "w1"
        assert steps[2].result is not None and steps[2].result["stdout"] == "streamed\n"
        assert steps[3].result is not None and steps[3].result["exit_code"] == 3
        lines = [json.loads(line) for line in sandbox.export_trajectory().splitlines()]
        assert [line["step_id"] for line in lines] == [s.step_id for s in steps]


def test_replayed_write_and_stream(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.files.write("/w", "one", step_id="w")
        sandbox.exec("echo changed > /w")
        assert sandbox.files.write("/w", "one", step_id="w").size == 3  # answered from the log
        assert sandbox.files.read_text("/w") == "changed\n"  # and not written again
        first = list(sandbox.exec_stream("echo x >> /n; cat /n", step_id="st"))
        again = list(sandbox.exec_stream("echo x >> /n; cat /n", step_id="st"))
        assert first[-1].result is not None and again[-1].result is not None and again[-1].result.replayed
        assert "".join(e.data or "" for e in again if e.type == "stdout") == "x\n"


def test_provenance(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.exec("mkdir -p /work && echo 1 > /work/a && echo 1 > /work/b", step_id="make")
        sandbox.exec("echo 2 > /work/b && rm /bin/vi", step_id="edit")
        sandbox.files.write("/work/c", "3", step_id="upload")
        assert [s.step_id for s in sandbox.provenance("/work/a")] == ["make"]
        assert [s.step_id for s in sandbox.provenance("/work/b")] == ["make", "edit"]
        assert [s.step_id for s in sandbox.provenance("/bin/vi")] == ["edit"]  # deletions count
        assert [s.step_id for s in sandbox.provenance("/work/c")] == ["upload"]


def test_provenance_in_a_writable_layer_of_thousands_of_files(client: corral.Client) -> None:
    """A step's changes among 3,000 files it left alone: written, created, deleted from a lower layer (a whiteout),
    a name with a space, a file an earlier step made and this one removed (nothing is left of it in the layer: the
    change journal's event names it), and nothing else."""
    with client.create("busybox", ttl_s=300) as sandbox:
        sandbox.exec("mkdir -p /work/many && cd /work/many && for d in $(seq 30); do mkdir $d; (cd $d && touch "
                     "$(seq 100)); done && echo x > /work/edit && echo y > /work/gone", timeout_s=120)  # fmt: skip
        sandbox.exec("echo changed > /work/edit; rm /work/gone; echo new > '/work/a b'; rm /bin/vi", step_id="big")
        steps = {step.step_id: step for step in sandbox.trajectory()}
        assert steps["big"].files == ["/bin/vi", "/work/a b", "/work/edit", "/work/gone"]
        assert [s.step_id for s in sandbox.provenance("/work/many/7/7")] == []
        assert [s.step_id for s in sandbox.provenance("/work/gone")] == ["big"]


def test_a_second_deletion_names_only_itself(client: corral.Client) -> None:
    """A step's files come from the node's change journal (the sandbox's writable layer is in the quota pool):
    overlayfs links every whiteout to one inode, so the second deletion touches the first whiteout's ctime too,
    and the walk of the layer would name /bin/vi again."""
    with client.create("busybox") as sandbox:
        sandbox.exec("rm /bin/vi", step_id="first")
        sandbox.exec("rm /bin/ls && echo x > /tmp/new", step_id="second")
        steps = {step.step_id: step for step in sandbox.trajectory()}
        assert steps["first"].files == ["/bin/vi"]
        assert steps["second"].files == ["/bin/ls", "/tmp/new"]


# Maps a file shared and writable, closes it (so no close after a write sends an event), says so in a file, then
# writes through the mapping at each SIGUSR1 and says that too: a process a step leaves running.
_MAPPER = r"""
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
static volatile sig_atomic_t asked;
static void ask(int signo) { (void)signo; asked = 1; }
static void say(const char *path) { int fd = open(path, O_WRONLY | O_CREAT, 0644); if (fd >= 0) close(fd); }
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int fd = open(argv[1], O_RDWR);
    char *mapped = fd < 0 ? MAP_FAILED : mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) return 1;
    close(fd);
    signal(SIGUSR1, ask);
    say(argv[2]);
    for (;;) {
        pause();
        if (asked) { asked = 0; memcpy(mapped, "after", 5); say(argv[3]); }
    }
}
"""


def test_a_write_through_a_shared_mapping_by_a_process_left_running_is_in_the_steps_files(
    client: corral.Client, tmp_path: Path
) -> None:
    """A write through a mapping sends the change journal no event: the files the sandbox's processes map shared and
    writable are the step's candidates. Such a process is one an earlier command left running; the agent itself,
    alone after most steps, is not read (it maps no file)."""
    source = tmp_path / "mapper.c"
    source.write_text(_MAPPER)
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler is not None, "the agent's build needs one too (scripts/setup.sh installs gcc)"
    subprocess.run([compiler, "-O2", "-static", "-o", str(tmp_path / "mapper"), str(source)], check=True)
    with client.create("busybox") as sandbox:
        sandbox.files.write("/work/mapper", (tmp_path / "mapper").read_bytes(), mode=0o755)
        sandbox.files.write("/work/mapped", b"before".ljust(4096, b"\0"))
        started = sandbox.exec(
            "/work/mapper /work/mapped /dev/shm/ready /dev/shm/written >/dev/null 2>&1 & echo $! > /dev/shm/pid;"
            " while [ ! -e /dev/shm/ready ]; do sleep 0.01; done"
        )
        assert started.exit_code == 0, started.stderr
        wrote = sandbox.exec("kill -USR1 $(cat /dev/shm/pid); while [ ! -e /dev/shm/written ]; do sleep 0.01; done;"
                             " head -c 5 /work/mapped", step_id="through-the-mapping")  # fmt: skip
        assert wrote.stdout == "after", wrote
        alone = sandbox.exec("kill $(cat /dev/shm/pid); echo x > /work/other", step_id="after-it-ended")
        assert alone.exit_code == 0, alone.stderr
        steps = {step.step_id: step for step in sandbox.trajectory()}
        assert steps["through-the-mapping"].files == ["/work/mapped"]
        assert steps["after-it-ended"].files == ["/work/other"]


def test_failed_step_replays_its_error(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        with pytest.raises(corral.InvalidRequest):
            sandbox.files.write("/", "x", step_id="bad")
        with pytest.raises(corral.InvalidRequest):
            sandbox.files.write("/", "x", step_id="bad")
        assert [s.state for s in sandbox.trajectory()] == ["done"]


def test_replay_reproduces_the_state(client: corral.Client) -> None:
    with client.create("busybox", env={"GREETING": "hi"}) as sandbox:
        sandbox.files.write("/work/input.txt", "3\n1\n2\n", step_id="upload")
        sandbox.exec("sort /work/input.txt > /work/sorted.txt && echo $GREETING", step_id="sort")
        sandbox.exec("date +%N > /work/nondeterministic", step_id="clock")
        result = sandbox.replay(labels={"why": "repro"})
        copy = client.connect(corral.Sandbox(result.sandbox, sandbox.url, sandbox.api_key))
        try:
            assert result.steps == 3 and result.skipped == []
            assert copy.files.read_text("/work/sorted.txt") == "1\n2\n3\n"
            assert result.sandbox.labels["corral.replay_of"] == sandbox.id
            assert [m.step_id for m in result.mismatches] == []  # date +%N goes to a file: stdout matches
        finally:
            copy.kill()


def test_every_file_change_is_logged_and_a_replay_makes_the_same_tree(client: corral.Client) -> None:
    """write, mkdir, tar upload, rename and remove (with and without client step ids) are steps of the log, and a
    replay of them gives a sandbox whose files are the same, member for member (issue 19)."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, data in (("pkg/a.txt", b"alpha\n"), ("pkg/sub/b.txt", b"beta\n"), ("pkg/gone.txt", b"x")):
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o640
            tar.addfile(member, io.BytesIO(data))
    tree = "find /work | sort | while read p; do stat -c '%n %F %a %s' \"$p\"; done; cat /work/pkg/a.txt /work/moved"
    with client.create("busybox") as sandbox:
        sandbox.files.mkdir("/work/empty/deep", mode=0o700, step_id="mk")
        assert sandbox.files.upload_tar("/work", archive.getvalue()) == 3  # its parents are made
        sandbox.files.write("/work/note.txt", "note\n", step_id="w")
        assert sandbox.files.rename("/work/note.txt", "/work/moved", step_id="mv").path == "/work/moved"
        sandbox.files.rename("/work/pkg/sub", "/work/pkg/renamed-dir")
        sandbox.files.remove("/work/pkg/gone.txt", step_id="rm")
        sandbox.files.remove("/work/empty", recursive=True)
        with pytest.raises(corral.Conflict, match="as a directory"):
            sandbox.files.rename("/work/moved", "/work/pkg")  # refused, and logged as failed: not replayed
        assert sandbox.files.mkdir("/work/empty/deep", mode=0o700, step_id="mk").path == "/work/empty/deep"
        assert not sandbox.files.exists("/work/empty")  # a resent step was answered from the log, not made again
        steps = sandbox.trajectory()
        assert [s.kind for s in steps] == ["mkdir", "upload_tar", "write_file", "rename", "rename", "remove",
                                           "remove", "rename"]  # fmt: skip
        assert steps[1].request["size"] == len(archive.getvalue()) and "data_b64" in steps[1].request
        assert steps[-1].result is not None and steps[-1].result["error"]["code"] == "conflict"
        expected = sandbox.exec(tree)
        assert "/work/pkg/renamed-dir/b.txt regular file 640 5" in expected.stdout
        assert "/work/empty" not in expected.stdout and "gone.txt" not in expected.stdout

        result = sandbox.replay()
        copy = client.connect(corral.Sandbox(result.sandbox, sandbox.url, sandbox.api_key))
        try:
            assert (result.steps, result.skipped, result.mismatches) == (8, [], [])  # 7 file steps, the listing
            assert copy.exec(tree).stdout == expected.stdout
        finally:
            copy.kill()


def test_output_cap_in_the_log_is_recorded(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.exec("head -c 3000000 /dev/zero | tr '\\0' a", step_id="big", output_cap_bytes=3_000_000)
        step = sandbox.trajectory()[-1]
        assert step.result_truncated and step.result is not None
        assert step.result["log_cap"]["stdout_bytes"] == 3_000_000
        assert len(step.result["stdout"]) == 1 << 20


def test_log_survives_a_crash_and_marks_inflight_steps_lost(fresh_server: EmbeddedServer) -> None:
    import threading
    import time

    with fresh_server.client() as client:
        sandbox = client.create("busybox")
        sandbox.exec("echo 1 >> /runs", step_id="done-before-crash")
        errors: list[BaseException] = []

        def run_long() -> None:
            try:
                client.connect(sandbox).exec("sleep 30", step_id="inflight")
            except corral.CorralError as exc:
                errors.append(exc)

        thread = threading.Thread(target=run_long)
        thread.start()
        time.sleep(0.5)
        fresh_server.stop(signal.SIGKILL)  # a crash in the middle of the step
        thread.join(timeout=30)
        assert errors and isinstance(errors[0], corral.ServerUnavailable)
    fresh_server.start()
    with fresh_server.client() as client:
        handle = client.connect(sandbox)
        assert handle.exec("echo 1 >> /runs", step_id="done-before-crash").replayed
        assert handle.exec("wc -l < /runs").stdout == "1\n"
        with pytest.raises(corral.Conflict, match="lost"):
            handle.exec("sleep 30", step_id="inflight")  # its outcome is unknown: not silently re-run
        assert [s.state for s in handle.trajectory()][:2] == ["done", "lost"]
