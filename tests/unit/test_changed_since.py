"""The walk of a writable layer for what a step changed (a step with a client's id records these paths)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from corral.backends.container import changes
from corral.backends.container.oci import AGENT_PATH


def test_the_walk_names_what_changed_since_and_nothing_older(tmp_path: Path) -> None:
    """Files, symlinks and whiteouts (character devices) at any depth, by ctime; directories and the agent's
    mount point are not named."""
    (tmp_path / "old").write_text("before")
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "kept").write_text("before")
    (tmp_path / AGENT_PATH.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    time.sleep(0.02)
    since = time.time()
    time.sleep(0.02)
    (tmp_path / "deep" / "er" / "new file").write_text("after")
    (tmp_path / "link").symlink_to("/nowhere")
    os.mknod(tmp_path / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # overlayfs's whiteout
    (tmp_path / AGENT_PATH.lstrip("/")).write_text("the agent's mount point")
    (tmp_path / "new dir").mkdir()
    assert changes.changed_since(tmp_path, since) == ["/deep/er/new file", "/gone", "/link"]
    assert changes.changed_since(tmp_path, time.time() + 1) == []


def test_the_walk_stops_at_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(changes, "CHANGED_PATHS_MAX", 5)
    for index in range(3):
        (tmp_path / f"d{index}").mkdir()
        for name in range(4):
            (tmp_path / f"d{index}" / f"f{name}").write_text("x")
    changed = changes.changed_since(tmp_path, 0.0)
    assert 5 <= len(changed) < 12 and changed == sorted(changed)
