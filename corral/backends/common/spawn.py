"""A program run to its end from the event loop, without asyncio's subprocess machinery.

Why: the server runs on uvloop (its HTTP handling and loop cost less: the server's CPU per exec 0.78 against 0.81
ms, docs/spec.md, Load), but uvloop starts a process with libuv's fork of the whole server, which cost a container
create nearly twice the host's CPU (a burst of 100 at 39-50/s against 68-86/s). ``subprocess.Popen``
starts it with vfork, as asyncio's own subprocesses do, and the end is a pidfd turning readable in the loop
(no child watcher, no thread per process). Its output goes to memfds, read once it has ended: no pipe to drain
while it runs and no size limit.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Awaitable, Callable
from typing import IO, TypeVar

__all__ = ["Output", "finished_before_cancel", "process_ended", "run_to_end"]

Output = int | IO[bytes] | None
T = TypeVar("T")

_KILLED_WAIT_S = 5.0  # for the end of a process killed at its timeout


async def run_to_end(
    args: list[str],
    *,
    timeout_s: float,
    on_start: Callable[[int], None],
    pass_fds: tuple[int, ...] = (),
    stdout: Output = None,
    stderr: Output = None,
    new_session: bool = False,
) -> tuple[int, bytes, bytes]:
    """Run ``args`` (stdin from /dev/null) and wait for its end: (exit status, stdout, stderr). ``stdout`` and
    ``stderr``: None, kept in a memfd and returned; else where they go (``subprocess.DEVNULL``, a file: a detached
    container inherits both, so neither may be something the server waits on). ``on_start`` gets the pid as soon
    as there is one. A process still running after ``timeout_s`` is killed and TimeoutError raised; a cancelled
    wait leaves it running (the node's reaper takes it when it ends)."""
    out = os.memfd_create("corral-stdout", os.MFD_CLOEXEC) if stdout is None else -1
    err = -1
    try:
        err = os.memfd_create("corral-stderr", os.MFD_CLOEXEC) if stderr is None else -1
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out if out >= 0 else stdout, stderr=err if err >= 0 else stderr,
            pass_fds=pass_fds, start_new_session=new_session,
        )  # fmt: skip
        on_start(process.pid)
        try:
            await process_ended(process.pid, timeout_s)
        except TimeoutError:
            process.kill()
            await process_ended(process.pid, _KILLED_WAIT_S)
            process.wait()
            raise
        return process.wait(), _contents(out), _contents(err)  # it has ended: wait only reaps it
    finally:
        for fd in (out, err):
            if fd >= 0:
                os.close(fd)


async def finished_before_cancel(step: Awaitable[T]) -> T:
    """Await ``step`` to its end even when the caller is cancelled meanwhile (then raise that cancellation): for a
    runtime or launcher process whose effects the caller's cleanup must see. A create cancelled while ``crun run``
    still ran had undone what it knew of at once; crun then started the container, an agent nobody would remove,
    holding its overlay and the node's pool (a warm pool's refill cut off by its server's stop)."""
    running_step = asyncio.ensure_future(step)
    cancelled = False
    while not running_step.done():
        try:
            await asyncio.wait({running_step})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not running_step.cancelled():
            running_step.exception()  # retrieved: the cancellation is what the caller gets
        raise asyncio.CancelledError
    return running_step.result()


async def process_ended(pid: int, timeout_s: float | None = None) -> None:
    """Wait until process ``pid`` has ended: its pidfd turns readable (a child not yet reaped, or any other process:
    a daemonized QEMU). ProcessLookupError if there is no such process already."""
    pidfd = os.pidfd_open(pid)
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait_for(ended, timeout_s)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _contents(fd: int) -> bytes:
    if fd < 0:
        return b""
    return os.pread(fd, os.fstat(fd).st_size, 0)
