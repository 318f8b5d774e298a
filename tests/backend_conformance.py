"""The checks every backend must pass, run against the ``Backend`` protocol directly (no edge, no gateway).

``python -m tests.backend_conformance KIND NODE_DIR DATA_DIR`` builds the backend for KIND (``container/crun``,
``container/runsc``, ``microvm``, ``vm``, ``simulated``), runs every check in order on one sandbox (checks that
need a sandbox of their own make one) and prints one JSON line per check: passed, skipped (naming the capability
the kind does not declare) or failed (with the traceback). It is a process of its own because a container
backend needs a private mount namespace (crun refuses hybrid cgroups otherwise), which the multi-threaded
pytest process cannot enter; tests/integration/test_backend_conformance.py turns each line into a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from corral.backends.base import (
    Backend,
    Capability,
    CommandExit,
    CommandOutput,
    CommandSpec,
    CommandStarted,
    FileTree,
    LayerRef,
    SandboxSpec,
    split_offer,
)
from corral.edge.protocol import new_sandbox_id
from corral.images.store import LayerStore
from corral.sdk import Conflict, CorralError, NotFound
from corral.testing.leftovers import find_leftovers

__all__ = ["CHECKS", "run"]

R = TypeVar("R")
_IMAGES = {"vm": "debian-12-systemd"}  # a full VM boots its image's own init; the rest run busybox
_HOUSEKEEPING_INTERVAL_S = 0.5
_PROCESSES = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"  # every command line; no ps needed
_EROFS_MAGIC = bytes.fromhex("e2e1f5e0")  # at byte 1024 of an EROFS image (little-endian 0xE0F5E1E2)
_CANCEL_POINTS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)  # of a whole create's time
_PAUSES = 100
_COUNTING = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; mv /tmp/c /tmp/count; done"
_PAUSED_LOOK_S = 0.02  # how long a paused sandbox is watched for progress
_LATE_EFFECTS_S = 1.0  # how long after the cancellations something left running could still appear


class Skipped(Exception):  # noqa: N818 - an outcome, not an error
    """The kind does not declare what the check needs."""


@dataclass
class Case:
    kind: str
    backend: Backend
    offer: str  # the offer key under test (its backend, and runtime if it takes one)
    capabilities: frozenset[Capability]
    base: SandboxSpec  # the shared sandbox's spec; ``fresh()`` makes specs for sandboxes of a check's own
    scratch: Path

    @property
    def sandbox_id(self) -> str:
        return self.base.sandbox_id

    def fresh(self, **changes: object) -> SandboxSpec:
        return replace(self.base, sandbox_id=new_sandbox_id("cf"), **changes)  # type: ignore[arg-type]

    def needs(self, capability: Capability) -> None:
        if capability not in self.capabilities:
            raise Skipped(f"{self.kind} does not declare {capability.value}")

    async def run(self, sandbox_id: str, script: str, stdin: bytes | None = None) -> tuple[int, str, str, list[str]]:
        """(exit code, stdout, stderr, event kinds in order) of ``/bin/sh -c script``."""
        command = CommandSpec(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, "/", "root", 30.0, 1 << 20, stdin)
        out, err, kinds, code = bytearray(), bytearray(), [], -1
        async for event in self.backend.run(sandbox_id, command).events():
            kinds.append(type(event).__name__)
            if isinstance(event, CommandOutput):
                (out if event.stream == "stdout" else err).extend(event.data)
            elif isinstance(event, CommandExit):
                code = event.exit_code
        return code, out.decode(), err.decode(), kinds

    async def files(self, sandbox_id: str, operation: Callable[[FileTree], R]) -> R:
        """A file operation in a worker thread, on a tree taken on the loop, as the edge runs them (a guest's tree
        talks to the agent through the loop)."""
        tree = self.backend.files(sandbox_id)

        def call() -> R:
            with tree:
                return operation(tree)

        return await asyncio.to_thread(call)


async def check_offers(case: Case) -> None:
    offers = case.backend.offers()
    assert case.offer in offers, offers
    assert all(isinstance(capability, Capability) for caps in offers.values() for capability in caps)
    has_checkpoints = case.backend.checkpoints(case.sandbox_id) is not None
    assert has_checkpoints == (Capability.CHECKPOINTS in case.capabilities)


async def check_exec(case: Case) -> None:
    code, out, err, kinds = await case.run(case.sandbox_id, "echo conformance")
    assert (code, out, err) == (0, "conformance\n", "")
    assert kinds[0] == CommandStarted.__name__ and kinds[-1] == CommandExit.__name__
    assert kinds.count(CommandExit.__name__) == 1
    assert (await case.run(case.sandbox_id, "exit 3"))[0] == 3


async def check_terminal(case: Case) -> None:
    case.needs(Capability.TERMINALS)
    script = "stty size; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo tty; read line; stty size; echo got:$line"
    command = CommandSpec(
        ["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, "/", "root", 30.0, 1 << 20, b"", (30, 100)
    )
    running = case.backend.run(case.sandbox_id, command)
    out, streams, code = bytearray(), set(), -1
    async for event in running.events():
        if isinstance(event, CommandOutput):
            out.extend(event.data)
            streams.add(event.stream)
            if out.endswith(b"tty\r\n"):  # typed only now: the terminal echoes input as it arrives
                running.resize(40, 132)
                running.write_stdin(b"typed\r")
        elif isinstance(event, CommandExit):
            code = event.exit_code
    assert code == 0 and streams == {"stdout"}, (code, streams, out)
    assert out.decode().split("\r\n") == ["30 100", "tty", "typed", "40 132", "got:typed", ""], out


async def check_files(case: Case) -> None:
    sid = case.sandbox_id
    info = await case.files(sid, lambda t: t.write("/tmp/conformance/a.txt", b"alpha", mode=0o640))
    assert info.size == 5 and info.type == "file"
    assert await case.files(sid, lambda t: t.read("/tmp/conformance/a.txt", max_bytes=1024)) == b"alpha"
    assert (await case.files(sid, lambda t: t.stat("/tmp/conformance/a.txt"))).mode & 0o777 == 0o640
    await case.files(sid, lambda t: t.mkdir("/tmp/conformance/d", parents=True))
    listed = await case.files(sid, lambda t: t.list("/tmp/conformance"))
    assert sorted(entry.name for entry in listed) == ["a.txt", "d"]
    moved = await case.files(sid, lambda t: t.rename("/tmp/conformance/a.txt", "/tmp/conformance/new/b.txt"))
    assert (moved.path, moved.size) == ("/tmp/conformance/new/b.txt", 5)
    try:
        await case.files(sid, lambda t: t.rename("/tmp/conformance/new/b.txt", "/tmp/conformance/d"))
        raise AssertionError("a rename replaced a directory")
    except Conflict:
        pass
    await case.files(sid, lambda t: t.rename("/tmp/conformance/new/b.txt", "/tmp/conformance/a.txt"))
    assert await case.files(sid, lambda t: t.read("/tmp/conformance/a.txt", max_bytes=1024)) == b"alpha"
    await case.files(sid, lambda t: t.remove("/tmp/conformance", recursive=True))
    try:
        await case.files(sid, lambda t: t.stat("/tmp/conformance/a.txt"))
    except NotFound:
        return
    raise AssertionError("a removed file is still there")


async def check_pause_resume(case: Case) -> None:
    reclaim = await case.backend.pause(case.sandbox_id, wait_reclaim=True)
    assert reclaim.before_bytes >= 0 and reclaim.after_bytes >= 0
    await case.backend.resume(case.sandbox_id)
    assert (await case.run(case.sandbox_id, "echo awake"))[1] == "awake\n"


async def check_paused_means_stopped(case: Case) -> None:
    """Once pause returns, the kernel says the sandbox is frozen and nothing in it runs, even loops that fork all
    the time: crun's pause returned while the v1 freezer still said FREEZING (by hand: 92 of 300 pauses of such a
    loop on a loaded host, for up to 47 ms), and a lifecycle test saw a paused sandbox's loop run on. Read from the
    host while paused: crun only."""
    if case.kind != "container/crun":
        raise Skipped("reads a paused sandbox's cgroup and files from the host: crun sandboxes only")
    spec = case.fresh()
    await case.backend.create(spec)
    loop = "while true; do /bin/true; done & " + _COUNTING  # a process started all the time beside the counting
    events = case.backend.run(spec.sandbox_id, CommandSpec(["/bin/sh", "-c", loop], {"PATH": "/bin"}, "/", "root",
                                                           600.0, 1024, None)).events()  # fmt: skip
    try:
        assert isinstance(await anext(events), CommandStarted)
        await asyncio.sleep(0.2)

        async def count() -> bytes:
            return await case.files(spec.sandbox_id, lambda tree: tree.read("/tmp/count", max_bytes=32))

        unfrozen, moved = [], []
        for attempt in range(_PAUSES):
            await case.backend.pause(spec.sandbox_id)
            if not _frozen(spec.sandbox_id):
                unfrozen.append(attempt)
            first = await count()
            await asyncio.sleep(_PAUSED_LOOK_S)
            if await count() != first:
                moved.append(attempt)
            await case.backend.resume(spec.sandbox_id)
            await asyncio.sleep(0.005)
        assert not unfrozen and not moved, f"of {_PAUSES} pauses, not frozen at return: {unfrozen}; ran on: {moved}"
    finally:
        await case.backend.destroy(spec.sandbox_id)  # ends the loop, and with it the command's events


def _frozen(sandbox_id: str) -> bool:
    """What the kernel says of a crun sandbox's freezer: v1's freezer.state, or v2's cgroup.events."""
    v1 = Path(f"/sys/fs/cgroup/freezer/corral/{sandbox_id}/freezer.state")
    if v1.exists():
        return v1.read_text().strip() == "FROZEN"
    return "frozen 1" in Path(f"/sys/fs/cgroup/corral/{sandbox_id}/cgroup.events").read_text()


async def check_stats(case: Case) -> None:
    assert case.backend.resident_bytes(case.sandbox_id) > 0
    assert case.backend.disk_usage(case.sandbox_id) is None  # no disk_mb
    changed, pid_limit_hits = await case.backend.findings(case.sandbox_id)
    assert isinstance(changed, list) and pid_limit_hits == 0


async def check_changed_paths(case: Case) -> None:
    """(Outside /tmp: gVisor mounts a tmpfs of its own there, whose files are in no layer.)"""
    case.needs(Capability.LAYERS)
    since = await case.backend.fs_clock(case.sandbox_id)
    await case.files(case.sandbox_id, lambda t: t.write("/data/changed.txt", b"new"))
    changed = await case.backend.changed_paths(case.sandbox_id, since)
    assert "/data/changed.txt" in changed.paths and changed.how in ("journal", "walk", "guest", "record")


async def check_snapshot(case: Case) -> None:
    case.needs(Capability.LAYERS)
    await case.files(case.sandbox_id, lambda t: t.write("/data/kept.txt", b"in the layer"))
    dest = case.scratch / "diff.erofs"
    await case.backend.pack_diff(case.sandbox_id, dest)
    with open(dest, "rb") as layer:
        layer.seek(1024)
        assert layer.read(4) == _EROFS_MAGIC


async def check_fork(case: Case) -> None:
    """A checkpoint restored as a new sandbox has the parent's files and its running processes."""
    case.needs(Capability.CHECKPOINTS)
    checkpoints = case.backend.checkpoints(case.sandbox_id)
    assert checkpoints is not None
    await case.files(case.sandbox_id, lambda t: t.write("/tmp/fork.txt", b"before the checkpoint"))
    background = CommandSpec(["/bin/sh", "-c", "sleep 600"], {}, "/", "root", 900.0, 1024, None)
    events = case.backend.run(case.sandbox_id, background).events()
    assert isinstance(await anext(events), CommandStarted)
    dest = case.scratch / "checkpoint"
    await checkpoints.checkpoint(case.sandbox_id, dest)
    # (gVisor's checkpoint lets the agent go, and this stream with it; the process lives on, as the child shows)
    child = case.fresh(restore_from=str(dest))
    await case.backend.create(child)
    try:
        assert await case.files(child.sandbox_id, lambda t: t.read("/tmp/fork.txt", max_bytes=64)) == (
            b"before the checkpoint"
        )
        assert "sleep 600" in (await case.run(child.sandbox_id, _PROCESSES))[1]
    finally:
        await case.backend.destroy(child.sandbox_id)
    named = await checkpoints.save_checkpoint(case.sandbox_id)
    assert [info["id"] for info in checkpoints.list_checkpoints(case.sandbox_id)] == [named["id"]]
    assert checkpoints.checkpoint_dir(case.sandbox_id, str(named["id"])).is_dir()


async def check_recycle(case: Case) -> None:
    """fncall pools: a sandbox is reused only when the call left nothing; a kind without recycle never is."""
    if Capability.RECYCLE not in case.capabilities:
        assert not await case.backend.recycle(case.sandbox_id)
        raise Skipped(f"{case.kind} does not declare recycle (and refused it, as it must)")
    spec = case.fresh()
    await case.backend.create(spec)
    try:
        assert (await case.run(spec.sandbox_id, "echo pure"))[0] == 0
        assert await case.backend.recycle(spec.sandbox_id)
        await case.files(spec.sandbox_id, lambda t: t.write("/tmp/left-behind", b"x"))
        assert not await case.backend.recycle(spec.sandbox_id)
    finally:
        await case.backend.destroy(spec.sandbox_id)


async def _next_create_works(case: Case) -> None:
    again = case.fresh()
    await case.backend.create(again)
    try:
        assert (await case.run(again.sandbox_id, "echo again"))[1] == "again\n"
    finally:
        await case.backend.destroy(again.sandbox_id)


async def check_failed_create(case: Case) -> None:
    """A create that fails part-way (its stack's top layer is not EROFS, after the layers below it were
    taken) raises and leaves nothing: no sandbox that answers, no orphan, and the next create works."""
    if case.kind == "simulated":
        raise Skipped("the simulated backend reads no layers")
    garbage = case.scratch / "not-a-layer.erofs"
    garbage.write_bytes(b"\0" * 8192)
    broken = case.fresh(layers=(*case.base.layers, LayerRef("sha256:" + "f" * 64, garbage)))
    try:
        await case.backend.create(broken)
    except Exception:  # noqa: S110 - the failure is the point; what it left is checked below
        pass
    else:
        await case.backend.destroy(broken.sandbox_id)
        raise AssertionError("a stack with a layer that is not EROFS was created")
    assert broken.sandbox_id not in await case.backend.orphans({case.sandbox_id})
    data_dir = case.scratch.parent  # the backend's data dir: its directories, disks and sockets
    assert not [str(path) for path in data_dir.rglob(f"*{broken.sandbox_id}*")], "a failed create left files"
    # nor a cgroup (a VM's QEMU that died by itself as the guest failed to boot was still exiting at the cleanup)
    assert not (cgroups := find_leftovers(data_dir, {broken.sandbox_id}).cgroups), cgroups
    try:
        await case.run(broken.sandbox_id, "true")
    except CorralError:
        pass
    else:
        raise AssertionError("a failed create left a sandbox that runs commands")
    await _next_create_works(case)


async def check_cancelled_create(case: Case) -> None:
    """A create cancelled at any point (a warm pool's refill as its server stops, a caller gone) leaves nothing once
    the cancellation has gone through, nor a moment later: a runtime or launcher process the cancelled wait left
    running had started a container with nobody to remove it (an orphan agent holding its overlay). A networked
    sandbox's too (crun: its plug-in, a thread the cancellation does not stop, had attached it after the undo)."""
    if case.kind == "simulated":
        raise Skipped("the simulated backend starts nothing")
    variants: dict[str, Callable[[], SandboxSpec]] = {"no network": case.fresh}
    if case.kind == "container/crun":  # VMs here have no network fabric; gVisor has loopback only
        variants["networked"] = lambda: case.fresh(network=())
    for variant, fresh in variants.items():
        cancelled = await _cancel_creates(case, fresh)
        assert len(cancelled) >= len(_CANCEL_POINTS) // 2, f"{variant}: only {len(cancelled)} creates were cut off"
        for moment in ("at once", f"{_LATE_EFFECTS_S:.0f} s later"):
            if moment != "at once":
                await asyncio.sleep(_LATE_EFFECTS_S)
            found = await _left_by(case, cancelled, networked=variant == "networked")
            assert not any(found.values()), f"cancelled creates ({variant}) left, {moment}: {found}"
    await _next_create_works(case)


async def _cancel_creates(case: Case, fresh: Callable[[], SandboxSpec]) -> list[str]:
    """Creates cancelled at points across a whole create's time; the ids of those the cancellation cut off."""
    for _ in range(2):  # the second one's time: the first may start what later creates find started (a network)
        probe = fresh()
        begun = time.monotonic()
        await case.backend.create(probe)
        whole_s = time.monotonic() - begun
        await case.backend.destroy(probe.sandbox_id)
    cancelled: list[str] = []
    for point in _CANCEL_POINTS:
        spec = fresh()
        task = asyncio.get_running_loop().create_task(case.backend.create(spec))
        await asyncio.sleep(whole_s * point)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled.append(spec.sandbox_id)
        else:  # it finished before the cancellation reached it
            await case.backend.destroy(spec.sandbox_id)
    return cancelled


async def _left_by(case: Case, sandbox_ids: list[str], *, networked: bool) -> dict[str, list[str] | list[int]]:
    """What of these sandboxes is on the host or in the backend's books (``networked``: its network's too)."""
    data_dir, ids = case.scratch.parent, set(sandbox_ids)
    left = find_leftovers(data_dir, ids, server_pid=os.getpid())
    addressed: list[str] = []
    if networked:
        fabric = await case.backend.network_fabric()  # type: ignore[attr-defined]  # a container backend's
        addressed = sorted(sandbox_id for sandbox_id in ids if fabric.address_of(sandbox_id) is not None)
    return {
        "orphans": sorted(set(await case.backend.orphans({case.sandbox_id})) & ids),
        "files": [str(path) for sandbox_id in ids for path in data_dir.rglob(f"*{sandbox_id}*")],
        "containers": sorted(set(left.containers) & ids), "processes": left.processes, "cgroups": left.cgroups,
        "mounts": [line for line in left.mounts if any(sandbox_id in line for sandbox_id in ids)],
        "veths": left.veths, "netns_names": left.netns_names, "addresses": addressed,
        "unretrieved_task_errors": _unretrieved_errors(),
    }  # fmt: skip


def _unretrieved_errors() -> list[str]:
    """Errors of tasks that ended with nobody to read them, reported by the loop (``_note_unhandled``): a cancelled
    VM create left its agent's greeting to fail so once QEMU was killed."""
    gc.collect()  # the loop reports such a task when it is collected
    return [str(context.get("exception") or context.get("message")) for context in _UNHANDLED]


_UNHANDLED: list[dict[str, object]] = []


def _note_unhandled(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    _UNHANDLED.append(context)
    loop.default_exception_handler(context)


async def check_destroy(case: Case) -> None:
    """Last: the shared sandbox goes, twice (idempotent), leaves no process nor cgroup (on a hybrid host also none
    of the directories crun makes in the tmpfs over the v2 mount: kept, they would fill it after ~16,000 creates), and
    nothing answers for it afterwards."""
    await case.backend.destroy(case.sandbox_id)
    await case.backend.destroy(case.sandbox_id)
    left = find_leftovers(case.scratch.parent, {case.sandbox_id})
    assert not left.processes and not left.cgroups, left
    try:
        await case.run(case.sandbox_id, "true")
    except CorralError:
        return
    raise AssertionError("a destroyed sandbox still runs commands")


CHECKS: dict[str, Callable[[Case], Awaitable[None]]] = {
    check.__name__.removeprefix("check_"): check
    for check in (
        check_offers, check_exec, check_terminal, check_files, check_pause_resume, check_paused_means_stopped,
        check_stats, check_changed_paths,
        check_snapshot, check_fork, check_recycle, check_failed_create, check_cancelled_create, check_destroy,
    )
}  # fmt: skip


def _layers(node_dir: Path, image: str) -> tuple[LayerRef, ...]:
    store = LayerStore(node_dir / "layers")
    record = next(record for record in store.images() if record.name == image)
    return tuple(LayerRef(digest, store.layer_path(digest)) for digest in record.layers)


async def _keep_house(backend: Backend) -> None:
    """What the edge does about once a second: a runtime's exited processes are reaped here, as our children."""
    while True:
        await asyncio.sleep(_HOUSEKEEPING_INTERVAL_S)
        backend.housekeeping()


@contextlib.asynccontextmanager
async def _backend(kind: str, node_dir: Path, data_dir: Path) -> AsyncIterator[Backend]:
    if kind == "simulated":
        from corral.testing.simulated import SimulatedBackend

        yield SimulatedBackend()
        return
    from corral.backends.common import host

    layout = host.detect_cgroup_layout()
    helpers = host.build_native_helpers(node_dir)
    backend: Backend
    if kind.startswith("container/"):
        from corral.backends.container.backend import ContainerBackend

        host.ensure_run_tmpfs()  # in the host's namespace, as a node does
        host.enter_private_mount_namespace(layout)
        host.become_child_subreaper()
        backend = ContainerBackend(
            data_dir=data_dir, helpers=helpers, layout=layout, default_runtime="crun", agent_start_timeout_s=30,
            layer_idle_unmount_s=60, create_concurrency=4, destroy_concurrency=4, audit_repeat_window_s=30,
        )  # fmt: skip
    else:
        from corral.backends.vm.backend import VmBackend

        backend = VmBackend(kind=kind, data_dir=data_dir, node_dir=node_dir, guest_agent=helpers.agent,
                            boot_timeout_s=120, cgroup_layout=layout)  # fmt: skip
    asyncio.get_running_loop().set_exception_handler(_note_unhandled)
    upkeep = asyncio.get_running_loop().create_task(_keep_house(backend))
    try:
        yield backend
    finally:
        upkeep.cancel()
        await backend.close()


async def run(kind: str, node_dir: Path, data_dir: Path) -> AsyncIterator[dict[str, str]]:
    """Every check on ``kind``, in order, each as {check, outcome, detail} once it is done."""
    async with _backend(kind, node_dir, data_dir) as backend:
        offer = "container" if kind == "simulated" else kind
        backend_name, runtime = split_offer(offer)
        image = _IMAGES.get(kind, "busybox")
        base = SandboxSpec(
            sandbox_id=new_sandbox_id("cf"), image=image, layers=_layers(node_dir, image), runtime=runtime or "crun",
            cpu=1, memory_mb=256, pids_max=256, backend=backend_name,
        )  # fmt: skip
        with tempfile.TemporaryDirectory(dir=data_dir, prefix="scratch-") as scratch:
            case = Case(kind, backend, offer, backend.offers()[offer], base, Path(scratch))
            await backend.create(base)
            try:
                for name, check in CHECKS.items():
                    try:
                        await check(case)
                    except Skipped as why:
                        yield {"check": name, "outcome": "skipped", "detail": str(why)}
                    except Exception:
                        yield {"check": name, "outcome": "failed", "detail": traceback.format_exc()}
                    else:
                        yield {"check": name, "outcome": "passed", "detail": ""}
            finally:
                await backend.destroy(base.sandbox_id)


async def _main(kind: str, node_dir: Path, data_dir: Path) -> None:
    async for result in run(kind, node_dir, data_dir):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
