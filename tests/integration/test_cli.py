"""The everyday CLI verbs against a real server: pause, resume, fork, cp both ways, logs, top (issue 21)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import REPO


def _cli(server: EmbeddedServer, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "corral.cli.main", *args], env=server.env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, f"corral {' '.join(args)}: {done.stderr}"
    return done


def test_pause_resume_fork(server: EmbeddedServer, client: corral.Client) -> None:
    with client.create("busybox", memory_mb=64) as sandbox:
        sandbox.exec("echo parent > /state")
        assert "paused in" in _cli(server, "pause", sandbox.id).stdout
        assert client.get(sandbox.id).info.state == corral.SandboxState.PAUSED
        assert _cli(server, "resume", sandbox.id).stdout.strip() == f"{sandbox.id} running"
        children = _cli(server, "fork", sandbox.id, "-n", "2", "-l", "role=child").stdout.split()
        assert len(children) == 2 and all(c.startswith("sb-e0-") for c in children)
        try:
            for child_id in children:
                child = client.get(child_id)
                assert child.info.labels["role"] == "child"
                assert child.exec("cat /state").stdout == "parent\n"
        finally:
            for child_id in children:
                client.kill(child_id)


def test_cp_both_ways(server: EmbeddedServer, client: corral.Client, tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("one\n")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "two.txt").write_text("two\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    with client.create("busybox", memory_mb=64) as sandbox:
        _cli(server, "cp", str(tmp_path / "one.txt"), f"{sandbox.id}:/work/")
        assert sandbox.exec("cat /work/one.txt").stdout == "one\n"
        _cli(server, "cp", str(tree), f"{sandbox.id}:/work/tree")
        assert sandbox.exec("cat /work/tree/sub/two.txt; /work/tree/run.sh").stdout == "two\nran\n"

        sandbox.exec("mkdir -p /out/d && echo three > /out/d/three.txt && echo four > /out/four.txt")
        sandbox.exec("ln -s /etc /out/escape && ln -s d/three.txt /out/inside")
        _cli(server, "cp", f"{sandbox.id}:/out/four.txt", str(tmp_path / "four.txt"))
        assert (tmp_path / "four.txt").read_text() == "four\n"
        copied = _cli(server, "cp", f"{sandbox.id}:/out", str(tmp_path / "out"))
        assert (tmp_path / "out" / "d" / "three.txt").read_text() == "three\n"
        assert (tmp_path / "out" / "inside").read_text() == "three\n"  # a link within the copy is kept
        assert not (tmp_path / "out" / "escape").is_symlink()  # one out of it is not
        assert "skipped out/escape: it links outside (/etc)" in copied.stdout
        _cli(server, "cp", f"{sandbox.id}:/out", str(tmp_path / "out"))  # into an existing directory: a child
        assert (tmp_path / "out" / "out" / "four.txt").read_text() == "four\n"


def test_logs_and_top(server: EmbeddedServer, client: corral.Client) -> None:
    with client.create("busybox", memory_mb=64) as sandbox:
        sandbox.exec("echo logged-output")
        sandbox.exec("exit 3")
        sandbox.files.write("/notes.txt", "n")
        logs = _cli(server, "logs", sandbox.id, "--output").stdout.splitlines()
        assert any("exec" in line and "exit 0" in line and "echo logged-output" in line for line in logs), logs
        assert any("stdout: logged-output" in line for line in logs), logs
        assert any("exit 3" in line for line in logs), logs
        assert any("write_file" in line and "/notes.txt" in line for line in logs), logs
        top = _cli(server, "top", "--once").stdout
        assert "e0" in top and "container" in top and "MiB" in top


def test_create_a_batch_with_progress(server: EmbeddedServer, client: corral.Client) -> None:
    created = _cli(server, "create", "busybox", "-n", "3", "--memory-mb", "64", "-l", "cli-batch=1")
    ids = created.stdout.split()
    try:
        assert len(ids) == 3 and len(set(ids)) == 3
        listed = {s.id for s in client.list(labels={"cli-batch": "1"})}
        assert listed == set(ids)
    finally:
        for sandbox_id in ids:
            client.kill(sandbox_id)
