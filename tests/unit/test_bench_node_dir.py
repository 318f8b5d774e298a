"""A bench's servers run on a node dir of the bench's own: what they build never lands in the user's."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from corral.backends.common.host import is_child_subreaper
from corral.bench.harness import bench_session, own_node_dir
from corral.config import Settings


def test_a_bench_names_a_node_dir_of_its_own_with_the_users_layers_linked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    users = tmp_path / "users-node"
    layer = users / "layers" / "layers" / "0123abcd.erofs"
    layer.parent.mkdir(parents=True)
    layer.write_bytes(b"a layer")
    monkeypatch.setenv("CORRAL_NODE_DIR", str(users))
    with own_node_dir(tmp_path / "scratch") as node_dir:
        assert node_dir.is_relative_to(tmp_path / "scratch")
        assert Settings().node_dir == node_dir  # this process's settings and every server it starts
        assert (node_dir / "layers" / "layers" / layer.name).stat().st_ino == layer.stat().st_ino  # linked, not copied
        (node_dir / "vm" / "templates" / "t1").mkdir(parents=True)  # what a bench's server builds
        (node_dir / "layers" / "layers" / "fork.erofs").write_bytes(b"a fork's diff layer")
    assert os.environ["CORRAL_NODE_DIR"] == str(users)
    assert sorted(path.relative_to(users).as_posix() for path in users.rglob("*")) == [
        "layers", "layers/layers", "layers/layers/0123abcd.erofs"
    ]  # fmt: skip


def test_a_caller_that_named_no_node_dir_gets_none_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_NODE_DIR", raising=False)  # the default node dir's files linked (hard links: cheap)
    with own_node_dir(tmp_path / "scratch") as node_dir:
        assert os.environ["CORRAL_NODE_DIR"] == str(node_dir)
    assert "CORRAL_NODE_DIR" not in os.environ


def test_a_bench_session_runs_on_a_node_dir_of_its_own_in_its_scratch_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What every bench that starts its own server opens (``bench_session``): its node dir is its scratch dir's,
    gone with it, and the caller's is named again after. The process is a subreaper during the session only: a test
    process left one kept the orphans of the tests after it (a server whose caller was killed stayed a zombie)."""
    users = tmp_path / "users-node"
    (users / "layers" / "layers").mkdir(parents=True)
    monkeypatch.setenv("CORRAL_NODE_DIR", str(users))
    assert not is_child_subreaper()
    with bench_session("node-dir-probe", as_json=True, console=Console(file=io.StringIO())) as (scratch, _):
        assert Settings().node_dir.is_relative_to(scratch) and Settings().node_dir.is_dir()
        assert is_child_subreaper()
    assert not scratch.exists()
    assert os.environ["CORRAL_NODE_DIR"] == str(users)
    assert not is_child_subreaper()
