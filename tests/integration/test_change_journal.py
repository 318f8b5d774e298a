"""The change journal against the walk it stands in for, on a real quota pool (btrfs on a loop device) with an
overlay over a subvolume, as a container sandbox's root is: each step's answer is the walk's, better where the walk
cannot see (a removed file only the layer held, old whiteouts it names again), or None (the walk's turn) where the
journal cannot be sure."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral.backends.container.changes import ChangeJournal, changed_since
from corral.backends.container.writable import QuotaPool

LIMIT_BYTES = 1 << 30


@dataclass
class Layer:
    """A sandbox's layer as the backend has it: its subvolume's upper dir, and the overlay's merged root."""

    pool: QuotaPool
    tree_id: int
    upper: Path
    root: Path  # what the sandbox sees: writes go through overlayfs into ``upper``


@pytest.fixture
def layer(tmp_path: Path) -> Iterator[Layer]:
    pool = QuotaPool(tmp_path / "data")
    pool.open()
    merged = tmp_path / "merged"
    try:
        subvolume = pool.add("sandbox", LIMIT_BYTES)
        (subvolume / "upper").mkdir()
        (subvolume / "work").mkdir()
        lower = tmp_path / "lower"
        (lower / "bin").mkdir(parents=True)
        (lower / "etc" / "deep").mkdir(parents=True)
        for name in ("vi", "ls", "cat", "sh"):
            (lower / "bin" / name).write_text(name)
        (lower / "etc" / "deep" / "conf").write_text("lower")
        merged.mkdir()
        options = f"lowerdir={lower},upperdir={subvolume / 'upper'},workdir={subvolume / 'work'}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True, timeout=30)
        yield Layer(pool, pool.tree_id("sandbox"), subvolume / "upper", merged)
    finally:
        if os.path.ismount(merged):
            subprocess.run(["umount", str(merged)], check=True, timeout=30)
        pool.remove("sandbox")
        pool.close()


@pytest.fixture
def journal(layer: Layer) -> Iterator[ChangeJournal]:
    journal = ChangeJournal(layer.pool.mountpoint)
    journal.open()
    yield journal
    journal.close()


def _clock(marker: Path) -> float:
    """A step's clock, as the backend's fs_clock takes it: the kernel's file clock, once it has ticked."""
    marker.write_bytes(b"")
    before = marker.stat().st_ctime_ns
    while True:
        marker.write_bytes(b"")
        if (now := marker.stat().st_ctime_ns) > before:
            return now / 1e9
        time.sleep(0.0005)


def _begin(journal: ChangeJournal, layer: Layer) -> float:
    position = journal.begin(layer.tree_id, layer.upper)
    clock = _clock(layer.upper.parent.parent.parent / "clock")  # next to the pool, not in it
    journal.started(layer.tree_id, clock, position)
    return clock


def _step(journal: ChangeJournal, layer: Layer, act: Callable[[Path], object], pids: tuple[int, ...] = ()) -> tuple[
        list[str] | None, list[str]]:  # fmt: skip
    """What the journal and the walk name for a step that does ``act`` in the sandbox's root."""
    since = _begin(journal, layer)
    act(layer.root)
    return journal.changed(layer.tree_id, since, pids), changed_since(layer.upper, since)


def _make(path: Path, *, remove: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    if remove:
        path.unlink()


STEPS: dict[str, tuple[Callable[[Path], object], list[str]]] = {
    "a new file": (lambda root: (root / "new").write_text("x"), ["/new"]),
    "a write to a lower file (copy-up)": (lambda root: (root / "bin" / "cat").write_text("dog"), ["/bin/cat"]),
    "a chmod of a lower file": (lambda root: os.chmod(root / "bin" / "sh", 0o700), ["/bin/sh"]),
    "a truncate": (lambda root: os.truncate(root / "bin" / "ls", 0), ["/bin/ls"]),
    "new times": (lambda root: os.utime(root / "bin" / "ls", (1, 1)), ["/bin/ls"]),
    "an xattr": (lambda root: os.setxattr(root / "bin" / "cat", "user.k", b"v"), ["/bin/cat"]),
    "new directories and a file": (lambda root: _make(root / "a" / "b" / "c d"), ["/a/b/c d"]),
    "a file in a lower directory": (lambda root: (root / "etc" / "deep" / "new").write_text("x"), ["/etc/deep/new"]),
    "a deletion of a lower file (a whiteout)": (lambda root: (root / "bin" / "vi").unlink(), ["/bin/vi"]),
    "a symlink": (lambda root: (root / "link").symlink_to("/nowhere"), ["/link"]),
    "a rename": (lambda root: (root / "etc" / "deep" / "conf").rename(root / "moved"), ["/etc/deep/conf", "/moved"]),
    "a file made and removed": (lambda root: _make(root / "tmp", remove=True), []),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_the_journal_names_what_the_walk_names(journal: ChangeJournal, layer: Layer, name: str) -> None:
    (layer.root / "earlier").write_text("an earlier step's")
    act, expected = STEPS[name]
    found, walked = _step(journal, layer, act)
    assert walked == expected
    assert found == expected


class Mapper:
    """A process chrooted into the sandbox's root that maps a file shared and writes to it when told."""

    SCRIPT = """
import mmap, os, sys
os.chroot(sys.argv[1]); os.chdir("/")
with open(sys.argv[2], "r+b") as file, mmap.mmap(file.fileno(), 4096) as mapping:
    for line in sys.stdin:
        if line.strip() == "sync":
            mapping.flush(); os.sync()
        else:
            mapping[:len(line) - 1] = line[:-1].encode()
        print("done", flush=True)
"""

    def __init__(self, root: Path, path: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", self.SCRIPT, str(root), path], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip

    def do(self, line: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == "done\n"

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            assert self.process.wait(timeout=30) == 0
        finally:
            if self.process.poll() is None:  # hung: it holds the overlay the fixture unmounts
                self.process.kill()
                self.process.wait()


def test_a_write_through_a_shared_mapping(journal: ChangeJournal, layer: Layer) -> None:
    """A write through a mapping sends no event: while it is mapped, the sandbox's processes' maps name the file;
    once the last mapping is closed, the close after writing does. (The walk sees its ctime when a write faults
    on a page written back since.)"""
    (layer.root / "etc" / "mapped").write_bytes(b"before".ljust(4096, b"\0"))
    mapper = Mapper(layer.root, "/etc/mapped")
    try:
        mapper.do("sync")
        since = _begin(journal, layer)
        mapper.do("after")
        walked = changed_since(layer.upper, since)
        assert journal.changed(layer.tree_id, since, (mapper.process.pid,)) == walked == ["/etc/mapped"]
        mapper.do("sync")
        since = _begin(journal, layer)
        mapper.do("again")
        assert journal.changed(layer.tree_id, since) == []  # without the maps: no event named it
        mapper.do("sync")
        since = _begin(journal, layer)
        mapper.do("last")
    finally:
        mapper.close()
    assert journal.changed(layer.tree_id, since) == changed_since(layer.upper, since) == ["/etc/mapped"]


def _remove_and_make(path: Path) -> None:
    """Removed, made again and removed: whether the name was there before the step cannot be told."""
    path.unlink()
    _make(path, remove=True)


def _save_over(path: Path) -> None:
    """An editor's save: a new file renamed over the old."""
    path.with_name(path.name + ".swp").write_text("saved")
    path.with_name(path.name + ".swp").rename(path)


@pytest.mark.parametrize(
    ("act", "expected", "walked"),
    [
        (lambda root: (root / "mine").unlink(), ["/mine"], []),
        (lambda root: (root / "mine").rename(root / "yours"), ["/mine", "/yours"], ["/yours"]),
        (lambda root: _remove_and_make(root / "mine"), [], []),
        (lambda root: _save_over(root / "mine"), ["/mine"], ["/mine"]),
    ],
    ids=["removed", "moved away", "removed, made again and removed", "saved over"],
)
def test_a_file_an_earlier_step_made_and_this_one_took_away(journal: ChangeJournal, layer: Layer,
                                                            act: Callable[[Path], object], expected: list[str],
                                                            walked: list[str]) -> None:  # fmt: skip
    """Only the writable layer held it, so nothing is left where it was (no whiteout) and the walk cannot name it;
    the journal names it unless the step also made a file of that name."""
    (layer.root / "mine").write_text("an earlier step's")
    assert _step(journal, layer, act) == (expected, walked)


def test_a_new_whiteout_names_only_itself(journal: ChangeJournal, layer: Layer) -> None:
    """Overlayfs links every whiteout to one inode, so a new one touches the old ones' ctime: the walk names
    them again, the journal does not."""
    (layer.root / "bin" / "vi").unlink()
    found, walked = _step(journal, layer, lambda root: (root / "bin" / "ls").unlink())
    assert found == ["/bin/ls"]
    assert walked == ["/bin/ls", "/bin/vi"]
    assert stat.S_ISCHR(os.lstat(layer.upper / "bin" / "vi").st_mode)


def test_a_hard_links_other_name_sends_the_step_to_the_walk(journal: ChangeJournal, layer: Layer) -> None:
    (layer.root / "one").write_text("x")
    found, walked = _step(journal, layer, lambda root: os.link(root / "one", root / "two"))
    assert found is None and walked == ["/one", "/two"]
    found, walked = _step(journal, layer, lambda root: (root / "two").unlink())
    assert found is None and walked == ["/one"]  # its link count changed: nothing named it
    found, walked = _step(journal, layer, lambda root: (root / "one").write_text("y"))
    assert found == walked == ["/one"]  # a single name again


def test_other_layers_and_overlays_work_dir_are_not_named(journal: ChangeJournal, layer: Layer) -> None:
    other = layer.pool.add("other", LIMIT_BYTES)
    try:

        def act(root: Path) -> None:
            (other / "elsewhere").write_text("another sandbox's")
            (layer.upper.parent / "work" / "scratch").write_text("overlay's own")
            (root / "bin" / "cat").write_text("copied up through the work dir")

        assert _step(journal, layer, act) == (["/bin/cat"], ["/bin/cat"])
    finally:
        layer.pool.remove("other")


def test_overlapping_steps_each_get_what_changed_since_their_clock(journal: ChangeJournal, layer: Layer) -> None:
    first = _begin(journal, layer)
    (layer.root / "a").write_text("x")
    second = _begin(journal, layer)
    (layer.root / "b").write_text("x")
    assert journal.changed(layer.tree_id, second) == changed_since(layer.upper, second) == ["/b"]
    (layer.root / "c").write_text("x")
    assert journal.changed(layer.tree_id, first) == changed_since(layer.upper, first) == ["/a", "/b", "/c"]
    assert journal.changed(layer.tree_id, first) is None  # asked already: that step has ended


def test_a_clock_it_did_not_see_begin_goes_to_the_walk(journal: ChangeJournal, layer: Layer) -> None:
    """A clock from before a restart, or from a step whose begin was abandoned, has no position here."""
    since = _clock(layer.upper.parent.parent.parent / "clock")
    (layer.root / "a").write_text("x")
    assert journal.changed(layer.tree_id, since) is None
    position = journal.begin(layer.tree_id, layer.upper)
    journal.abandon(layer.tree_id, position)
    assert journal.changed(layer.tree_id, since) is None


def test_lost_events_send_the_steps_open_then_to_the_walk(layer: Layer) -> None:
    """A queue that overflows (more events than fs.fanotify.max_queued_events between two reads) loses events:
    the steps open then are answered by the walk, later ones by the journal again."""
    journal = ChangeJournal(layer.pool.mountpoint, drain_interval_s=3600.0)  # only a step's question reads it
    journal.open()
    try:
        limit = int(Path("/proc/sys/fs/fanotify/max_queued_events").read_text())
        since = _begin(journal, layer)
        flood = layer.root / "flood"
        flood.mkdir()
        for index in range(limit // 2 + 1):  # a create and a write each: past the limit
            (flood / str(index)).write_bytes(b"x")
        assert journal.changed(layer.tree_id, since) is None
        found, walked = _step(journal, layer, lambda root: (root / "after").write_text("x"))
        assert found == walked == ["/after"]
    finally:
        journal.close()


def _filesystem_marks() -> int:
    """The fanotify filesystem marks this process's groups hold, as the kernel lists them (fdinfo)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[fanotify]":
                count += Path(f"/proc/self/fdinfo/{fd}").read_text().count("fanotify sdev:")
        except OSError:
            continue  # the listing's own descriptor
    return count


def test_the_filesystem_is_marked_only_while_a_step_is_open(journal: ChangeJournal, layer: Layer) -> None:
    """While marked, every create and write in every sandbox on the node is an event: no step open, no mark."""
    assert _filesystem_marks() == 0
    first = _begin(journal, layer)
    second = _begin(journal, layer)
    assert _filesystem_marks() == 1
    (layer.root / "a").write_text("x")
    assert journal.changed(layer.tree_id, first) == ["/a"]
    assert _filesystem_marks() == 1  # the second is still open
    assert journal.changed(layer.tree_id, second) == ["/a"]
    assert _filesystem_marks() == 0
    found, _ = _step(journal, layer, lambda root: (root / "b").write_text("x"))
    assert found == ["/b"] and _filesystem_marks() == 0


def test_an_answer_on_the_event_loop_leaves_a_step_with_much_queued_to_a_thread(layer: Layer) -> None:
    """``wait=False`` answers only when little is queued; otherwise it leaves the step as it was, and the answer
    in a thread (which reads everything) is the walk's."""
    journal = ChangeJournal(layer.pool.mountpoint, drain_interval_s=3600.0)  # only the steps read the queue
    journal.open()
    try:
        since = _begin(journal, layer)
        (layer.root / "a").write_text("x")
        assert journal.is_small(layer.tree_id)
        assert journal.changed(layer.tree_id, since, wait=False) == ["/a"]
        since = _begin(journal, layer)
        for index in range(500):  # ~60 KiB of events: more than an answer on the loop reads
            (layer.root / f"f{index}").write_text("x")
        assert journal.changed(layer.tree_id, since, wait=False) is None
        walked = changed_since(layer.upper, since)
        assert journal.changed(layer.tree_id, since) == walked and len(walked) == 500
        assert not journal.is_small(layer.tree_id)  # no step open: nothing kept
    finally:
        journal.close()
