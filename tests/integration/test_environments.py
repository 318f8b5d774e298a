"""Environments: layers built, imported, tagged, composed per sandbox, snapshotted.

Everything runs against a real server; builds write real EROFS files into the
tests' own node dir (see conftest), and sandboxes mount them for real.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

import corral
from corral.backends.common.host import runtime_dirs_of
from corral.embedded import EmbeddedServer
from tests.terminal import run_in_terminal


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _tar(members: dict[str, bytes | None], *, symlinks: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buffer.getvalue()


def test_base_images_are_in_the_catalogue(client: corral.Client) -> None:
    names = {image.name for image in client.images.list()}
    assert {"busybox:latest", "debian-12:latest"} <= names
    detail = client.images.inspect("busybox")
    assert [layer.kind for layer in detail.layers] == ["base"]


def test_tools_version_changes_without_rebuilding_base(client: corral.Client, tmp_path: Path) -> None:
    v1 = client.images.build("tools-a:1", "dir", path=str(_tree(tmp_path / "v1", {"opt/tools/VERSION": "1\n"})))
    v2 = client.images.build("tools-a:2", "dir", path=str(_tree(tmp_path / "v2", {"opt/tools/VERSION": "2\n"})))
    base = client.images.inspect("busybox").layers[0].digest
    for version, expected in [("tools-a:1", "1"), ("tools-a:2", "2")]:
        with client.create(environment={"base": "busybox", "tools": version}) as sandbox:
            assert sandbox.exec("cat /opt/tools/VERSION").stdout.strip() == expected
            assert sandbox.exec("ls /bin/sh").exit_code == 0  # the base is there underneath
            assert sandbox.info.image == f"busybox+{version}"
    assert client.images.inspect("busybox").layers[0].digest == base
    assert v1.layers != v2.layers
    assert [layer.kind for layer in client.images.inspect("tools-a:1").layers] == ["tools"]


def test_three_layers_compose_top_to_bottom(client: corral.Client, tmp_path: Path) -> None:
    client.images.build("ws-order", "dir", path=str(_tree(tmp_path / "ws", {"etc/who": "workspace\n", "w": "w\n"})))
    client.images.build("tools-order", "dir", path=str(_tree(tmp_path / "tl", {"etc/who": "tools\n", "t": "t\n"})))
    environment = {"base": "busybox", "workspace": "ws-order", "tools": "tools-order"}
    with client.create(environment=environment) as sandbox:
        assert sandbox.exec("cat /etc/who /w /t").stdout == "tools\nw\nt\n"  # tools > workspace > base
        sandbox.exec("echo mine > /etc/who")
        assert sandbox.exec("cat /etc/who").stdout == "mine\n"  # the sandbox's own upper dir is on top


def test_identical_builds_are_cached(client: corral.Client, tmp_path: Path) -> None:
    source = str(_tree(tmp_path / "c", {"a": "x"}))
    first = client.images.build("cached-a", "dir", path=source)
    lines: list[str] = []
    second = client.images.build("cached-b", "dir", path=source, on_progress=lines.append)
    assert second.layers == first.layers
    assert any(line.startswith("cached:") for line in lines)
    rebuilt = client.images.build("cached-c", "dir", path=source, no_cache=True, on_progress=lines.append)
    assert rebuilt.layers == first.layers  # the same tree gives the same bytes


def test_commands_build_keeps_only_the_changes(client: corral.Client) -> None:
    lines: list[str] = []
    image = client.images.build(
        "tool-cmd", "commands", on=["busybox"],
        commands=["mkdir -p /opt/tool && echo v1 > /opt/tool/version", "rm /bin/ls", "echo visible-progress"],
        on_progress=lines.append,
    )  # fmt: skip
    assert "  visible-progress" in lines
    base, diff = client.images.inspect("tool-cmd").layers
    assert base.digest == client.images.inspect("busybox").layers[0].digest
    assert diff.kind == "tools" and diff.parents == [base.digest] and diff.size_bytes < 1 << 20
    with client.create("tool-cmd") as sandbox:
        assert sandbox.exec("cat /opt/tool/version").stdout == "v1\n"
        assert sandbox.exec("test -e /bin/ls").exit_code == 1  # the whiteout came along
    assert image.layers == [base.digest, diff.digest]


def test_failing_build_shows_its_output_and_leaves_nothing(client: corral.Client) -> None:
    with pytest.raises(corral.InvalidRequest, match=r"(?s)exit 3.*the reason is here"):
        client.images.build("broken", "commands", on=["busybox"], commands=["echo the reason is here; exit 3"])
    assert "broken:latest" not in {image.name for image in client.images.list()}
    assert client.list(labels={"corral.builder": "broken"}) == []


def test_git_workspace_at_a_commit_with_setup(client: corral.Client, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (repo / "app.py").write_text("VERSION = 1\n")
    git("add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    (repo / "app.py").write_text("VERSION = 2\n")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "two")

    client.images.build("ws-git:one", "git", path=str(repo), commit=first)
    with client.create(environment={"base": "busybox", "workspace": "ws-git:one"}) as sandbox:
        assert sandbox.exec("cat /work/app.py").stdout == "VERSION = 1\n"
    client.images.build("ws-git:setup", "git", path=str(repo), on=["busybox"], commands=["echo built > /work/BUILT"])
    assert [layer.kind for layer in client.images.inspect("ws-git:setup").layers] == ["base", "workspace", "workspace"]
    with client.create(environment={"base": "busybox", "workspace": "ws-git:setup"}) as sandbox:
        assert sandbox.exec("cat /work/app.py /work/BUILT").stdout == "VERSION = 2\nbuilt\n"


def test_snapshot_branches_a_running_sandbox(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        sandbox.exec("mkdir -p /work && echo step-1 > /work/state && rm /bin/vi")
        snap = sandbox.snapshot(name="branch-k")
        assert snap.image == "branch-k:latest" and snap.diff.kind == "diff"
        assert sandbox.exec("echo step-2 >> /work/state").exit_code == 0  # the original carries on
        with client.create("branch-k") as branch, client.create(layers=snap.layers) as other:
            for copy in (branch, other):
                assert copy.exec("cat /work/state").stdout == "step-1\n"
                assert copy.exec("test -e /bin/vi").exit_code == 1
        assert sandbox.exec("cat /work/state").stdout == "step-1\nstep-2\n"


def test_import_tar_and_refuse_escapes(client: corral.Client) -> None:
    good = _tar({"opt/": None, "opt/hello.txt": b"hi\n", "/etc/abs.txt": b"abs\n"}, symlinks={"opt/link": "/etc"})
    image = client.images.import_archive("imported-tar", gzip.compress(good), layer_kind="tools")
    with client.create(environment={"base": "busybox", "tools": image.name}) as sandbox:
        assert sandbox.exec("cat /opt/hello.txt /etc/abs.txt").stdout == "hi\nabs\n"
    with pytest.raises(corral.InvalidRequest, match=r"\.\."):
        client.images.import_archive("evil-tar", _tar({"../../escape.txt": b"x"}))
    assert "evil-tar:latest" not in {i.name for i in client.images.list()}


def test_import_oci_archive_with_whiteouts(client: corral.Client) -> None:
    layer1 = _tar({"app/": None, "app/keep": b"k\n", "app/old": b"o\n", "bin/": None, "bin/tool": b"t\n"})
    layer2 = _tar({"app/.wh.old": b"", "app/new": b"n\n"})
    blobs = {
        "layer1.tar": layer1,
        "layer2.tar": layer2,
        "config.json": json.dumps({"config": {"Env": ["A=1"], "WorkingDir": "/app", "Cmd": ["ls"]}}).encode(),
    }
    manifest = [{"Config": "config.json", "RepoTags": ["demo:1"], "Layers": ["layer1.tar", "layer2.tar"]}]
    archive = _tar({**blobs, "manifest.json": json.dumps(manifest).encode()})
    image = client.images.import_archive("from-oci", archive, format="oci")
    assert [layer.kind for layer in client.images.inspect(image.name).layers] == ["base"]
    config = client.images.inspect(image.name).config  # the archive's image config is kept and applied
    assert (config.env, config.working_dir, config.cmd) == ({"A": "1"}, "/app", ["ls"])
    with client.create(environment={"base": "busybox", "extra": [image.name]}) as sandbox:
        assert sandbox.exec("ls").stdout.split() == ["keep", "new"]
        assert sandbox.exec("echo $A; pwd").stdout == "1\n/app\n"
    with pytest.raises(corral.NotFound):
        client.images.import_archive(
            "broken-oci",
            _tar({"manifest.json": json.dumps([{"Config": "c.json", "Layers": ["missing.tar"]}]).encode()}),
            format="oci",
        )


def test_bad_references(client: corral.Client) -> None:
    for ref in ["UPPER", "a/b", "..", "x:" + "v" * 200]:
        with pytest.raises((corral.InvalidRequest, corral.NotFound)):
            client.images.tag(ref, source="busybox")
    with pytest.raises(corral.NotFound):
        client.create(environment={"base": "no-such-base"})


def test_tag_untag_and_remove_layers(client: corral.Client, tmp_path: Path) -> None:
    built = client.images.build("removable", "dir", path=str(_tree(tmp_path / "r", {"f": "1"})))
    digest = built.layers[0]
    client.images.tag("removable:alias", source="removable")
    with pytest.raises(corral.Conflict, match="in use"):
        client.images.remove_layer(digest)
    client.images.untag("removable")
    client.images.untag("removable:alias")
    base = client.images.inspect("busybox").layers[0].digest
    with client.create(layers=[base, digest]) as sandbox:
        with pytest.raises(corral.Conflict, match="running sandboxes"):
            client.images.remove_layer(digest)
        sandbox.kill()
    client.images.remove_layer(digest)
    assert digest not in {layer.digest for layer in client.images.layers()}


def test_layer_is_mounted_once_for_many_sandboxes(client: corral.Client, server: EmbeddedServer) -> None:
    assert server.process is not None
    digest = client.images.inspect("busybox").layers[0].digest
    mountpoint = digest.replace(":", "-")
    sandboxes = [client.create("busybox") for _ in range(5)]
    try:
        mounts = Path(f"/proc/{server.process.pid}/mounts").read_text()
        assert sum(1 for line in mounts.splitlines() if mountpoint in line and " erofs " in line) == 1
    finally:
        for sandbox in sandboxes:
            sandbox.kill()


def test_corrupt_layer_is_refused(fresh_server: EmbeddedServer, tmp_path: Path) -> None:
    with fresh_server.client() as client:
        image = client.images.build("to-corrupt", "dir", path=str(_tree(tmp_path / "x", {"data": "y" * 10000})))
        layer_file = Path(fresh_server.env()["CORRAL_NODE_DIR"]) / "layers" / "layers" / f"{image.layers[0][7:]}.erofs"
        layer_file.chmod(0o644)
        with open(layer_file, "r+b") as f:
            f.seek(2048)
            f.write(b"\xff" * 64)
        with pytest.raises(corral.InternalError, match="corrupt"):
            client.create(environment={"base": "busybox", "tools": "to-corrupt"})
        assert client.list() == []
        assert list((fresh_server.data_dir / "sandboxes").iterdir()) == []  # nothing of the failed create is left
        assert list(runtime_dirs_of(fresh_server.data_dir).iterdir()) == []  # on disk nor in the run dir


def test_cli_build_import_tag_rm_snapshot(server: EmbeddedServer, tmp_path: Path) -> None:
    import sys

    from tests.conftest import REPO

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "corral.cli.main", *args],
            env=server.env(), cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    built = cli("images", "build", "cli-tools:1", "--from-dir", str(_tree(tmp_path / "t", {"opt/x": "1"})))
    assert built.returncode == 0 and "built cli-tools:1" in built.stdout, built.stderr
    commands = cli("images", "build", "cli-cmd", "--on", "busybox", "--run", "echo from-the-builder > /made")
    assert commands.returncode == 0 and "from-the-builder" not in commands.stderr, commands.stderr
    assert "\x1b" not in commands.stdout, "piped: plain lines, no spinner"
    argv = [sys.executable, "-m", "corral.cli.main", "images", "build", "cli-spin", "--on", "busybox", "--run",
            "sleep 1.5; echo spun > /spun"]  # fmt: skip
    code, screen = run_in_terminal(argv, server.env(), REPO, timeout_s=120)
    assert code == 0 and "built cli-spin:latest" in screen, screen[-3000:]
    assert re.search(r"building cli-spin 0:00:0[1-9]", screen), screen[-3000:]  # in a terminal: spinner and clock
    archive = tmp_path / "rootfs.tar"
    archive.write_bytes(_tar({"etc/": None, "etc/imported": b"yes\n"}))
    imported = cli("images", "import", str(archive), "cli-import", "--kind", "tools")
    assert imported.returncode == 0 and "imported cli-import:latest" in imported.stdout, imported.stderr
    assert cli("images", "tag", "cli-tools:1", "cli-tools:stable").returncode == 0
    composed = cli("create", "busybox", "--tools", "cli-tools:stable")
    assert composed.returncode == 0, composed.stderr
    assert cli("exec", composed.stdout.strip(), "cat /opt/x").stdout == "1"
    assert cli("rm", composed.stdout.strip()).returncode == 0
    listed = cli("images", "ls").stdout
    assert "cli-tools:stable" in listed and "cli-cmd:latest" in listed
    failed = cli("images", "build", "cli-bad", "--on", "busybox", "--run", "echo nope >&2; false")
    assert failed.returncode == 1 and "nope" in failed.stderr
    with server.client() as client, client.create("cli-cmd") as sandbox:
        assert sandbox.exec("cat /made").stdout == "from-the-builder\n"
        sandbox.exec("echo later > /later")
        snap = cli("snapshot", sandbox.id, "--name", "cli-snap")
        assert snap.returncode == 0 and "tagged cli-snap:latest" in snap.stdout, snap.stderr
    removed = cli("images", "rm", "cli-tools:stable", "cli-tools:1", "--prune")
    assert removed.returncode == 0 and "deleted layer" in removed.stdout, removed.stdout + removed.stderr


def test_idle_layers_are_unmounted_and_remounted(tmp_path: Path, test_env: dict[str, str]) -> None:
    env = {**test_env, "CORRAL_LAYER_IDLE_UNMOUNT_S": "0.3"}
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        assert server.process is not None
        image = client.images.build("idle-tools", "dir", path=str(_tree(tmp_path / "t", {"f": "1\n"})))
        mountpoint = image.layers[0].replace(":", "-")

        def mounted() -> bool:
            return mountpoint in Path(f"/proc/{server.process.pid}/mounts").read_text()  # type: ignore[union-attr]

        with client.create(environment={"base": "busybox", "tools": "idle-tools"}) as sandbox:
            assert sandbox.exec("cat /f").stdout == "1\n"
            assert mounted()
        deadline = time.monotonic() + 10
        while mounted():
            assert time.monotonic() < deadline, "an unused layer stayed mounted"
            time.sleep(0.1)
        with client.create(environment={"base": "busybox", "tools": "idle-tools"}) as sandbox:
            assert sandbox.exec("cat /f").stdout == "1\n"


def test_disk_budget_evicts_unused_untagged_layers_first(tmp_path: Path, test_env: dict[str, str]) -> None:
    env = {**test_env, "CORRAL_LAYER_DISK_BUDGET_MB": "1"}  # far below the base images: evict all that may go
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        old = client.images.build("old", "dir", path=str(_tree(tmp_path / "a", {"f": "a"}))).layers[0]
        client.images.untag("old")
        with client.create("busybox") as sandbox:
            snap = sandbox.snapshot()  # untagged, but just made: kept for now
        assert snap.diff.digest in {layer.digest for layer in client.images.layers()}
        lines: list[str] = []
        new = client.images.build("new", "dir", path=str(_tree(tmp_path / "b", {"f": "b"})), on_progress=lines.append)
        remaining = {layer.digest for layer in client.images.layers()}
        assert old not in remaining and snap.diff.digest not in remaining
        assert new.layers[0] in remaining and client.images.inspect("busybox").layers[0].digest in remaining
        assert any(line.startswith("evicted unused layer") for line in lines)


def test_full_disk_fails_the_build_cleanly(tmp_path: Path, test_env: dict[str, str]) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], check=True)
    try:
        with EmbeddedServer(small / "server", env=test_env) as server, server.client() as client:
            source = tmp_path / "big"
            source.mkdir()
            (source / "blob").write_bytes(os.urandom(8 << 20))
            layers_before = {layer.digest for layer in client.images.layers()}
            with pytest.raises(corral.CorralError, match="(?i)no space"):
                client.images.build("too-big", "dir", path=str(source))
            assert "too-big:latest" not in {image.name for image in client.images.list()}
            assert {layer.digest for layer in client.images.layers()} == layers_before
            assert list((small / "server" / "build").iterdir()) == []  # no half-written scratch left
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
