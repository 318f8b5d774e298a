"""nftables commands in other network namespaces, run by libnftables inside this process.

Why not ``nsenter --net=<ns> nft -f -``: two execs, nft's dynamic linking and its parse cost 4-7 ms of CPU a
command here, and every networked sandbox's create, claim and denied-packet audit (a listing per sandbox every
few seconds) paid it; libnftables does the same transaction in ~0.3-0.5 ms.

libnftables keeps process-wide state (a once-only init; an interface cache each run and each free release) and is
not safe from several threads, so one thread of the process runs every command: it enters the sandbox's namespace
(``setns`` moves that thread alone), runs the command and goes back. A context's netlink socket belongs to the
namespace it was made in, whatever the thread does after.

A context is freed ``_FREE_AFTER_S`` after its command, not at once: after a transaction that deleted rules, the
kernel releases them in a work item behind an RCU grace period, and a netfilter socket closed before that work ran
waits for it (10-25 ms here). Later the work has run and the close costs nothing, so a replacement does not hold up
the commands queued behind it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import heapq
import itertools
import os
import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from corral.api.errors import InternalError

__all__ = ["NftError", "run"]

_CLONE_NEWNET = 0x40000000
_NFT_CTX_DEFAULT = 0
_NFT_CTX_OUTPUT_JSON = 1 << 4
_FREE_AFTER_S = 0.05
_TIMEOUT_S = 10.0


class NftError(InternalError):
    """A command libnftables refused; ``detail`` is its error text, as ``nft`` prints it."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


@dataclass
class _Job:
    netns_path: str
    commands: str
    json_output: bool
    done: Future[str]


class _Library:
    """libnftables' calls, typed for ctypes."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise InternalError(f"libnftables is missing ({exc}): install Debian's nftables (libnftables1)") from None
        lib.nft_ctx_new.argtypes, lib.nft_ctx_new.restype = [ctypes.c_uint32], ctypes.c_void_p
        lib.nft_ctx_free.argtypes, lib.nft_ctx_free.restype = [ctypes.c_void_p], None
        lib.nft_ctx_output_set_flags.argtypes, lib.nft_ctx_output_set_flags.restype = (
            [ctypes.c_void_p, ctypes.c_uint],
            None,
        )
        for call in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, call).argtypes, getattr(lib, call).restype = [ctypes.c_void_p], ctypes.c_int
        for call in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, call).argtypes, getattr(lib, call).restype = [ctypes.c_void_p], ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes, lib.nft_run_cmd_from_buffer.restype = (
            [ctypes.c_void_p, ctypes.c_char_p],
            ctypes.c_int,
        )
        self.lib = lib
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns.argtypes, libc.setns.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        self.libc = libc

    def setns(self, fd: int) -> None:
        if self.libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns: {os.strerror(errno)}")


class _Runner:
    """The one thread that runs libnftables, and its queue."""

    def __init__(self) -> None:
        self._lib = _Library()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._to_free: list[tuple[float, int, int]] = []  # (when, tie-break, context): a heap
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._serve, name="corral-nftables", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def _serve(self) -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)  # before this thread moves
        while True:
            timeout = max(0.0, self._to_free[0][0] - time.monotonic()) if self._to_free else None
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                self._free_due()
                continue
            if job.done.set_running_or_notify_cancel():
                try:
                    job.done.set_result(self._run(job, home))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, the thread goes on
                    job.done.set_exception(exc)
            self._free_due()

    def _run(self, job: _Job, home: int) -> str:
        lib = self._lib.lib
        fd = os.open(job.netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._lib.setns(fd)
        finally:
            os.close(fd)
        try:
            ctx = lib.nft_ctx_new(_NFT_CTX_DEFAULT)
            if not ctx:
                raise InternalError(f"libnftables could not make a context in {job.netns_path}")
            heapq.heappush(self._to_free, (time.monotonic() + _FREE_AFTER_S, next(self._order), ctx))
            if job.json_output:
                lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON)
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            status = lib.nft_run_cmd_from_buffer(ctx, job.commands.encode())
            output = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            error = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        finally:
            self._lib.setns(home)  # never left in a sandbox's namespace (it would keep it alive)
        if status != 0:
            first = job.commands.splitlines()[0] if job.commands.strip() else ""
            raise NftError(f"nft in {job.netns_path} refused `{first}`...: {error.strip()}", error)
        return output

    def _free_due(self) -> None:
        now = time.monotonic()
        while self._to_free and self._to_free[0][0] <= now:
            self._lib.lib.nft_ctx_free(heapq.heappop(self._to_free)[2])


_runner: _Runner | None = None
_runner_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _runner, _runner_lock
    _runner, _runner_lock = None, threading.Lock()  # the thread did not come along


os.register_at_fork(after_in_child=_reset_after_fork)


def run(netns_path: str, commands: str, *, json_output: bool = False, timeout_s: float = _TIMEOUT_S) -> str:
    """Run ``commands`` (``nft -f`` syntax: one transaction) in the network namespace at ``netns_path``; returns
    what they printed (JSON with ``json_output``). The caller checks the path; this enters what it names.
    Raises NftError when nftables refuses, InternalError when the namespace cannot be entered or no answer
    came within ``timeout_s``."""
    global _runner
    with _runner_lock:
        if _runner is None:
            _runner = _Runner()
        runner = _runner
    job = _Job(netns_path, commands, json_output, Future())
    runner.submit(job)
    try:
        return job.done.result(timeout=timeout_s)
    except FutureTimeout:
        job.done.cancel()  # not run if it had not started
        raise InternalError(f"nft in {netns_path}: no answer within {timeout_s:g} s") from None
    except CancelledError:
        raise InternalError(f"nft in {netns_path}: cancelled") from None
    except OSError as exc:
        raise InternalError(f"nft in {netns_path}: cannot enter the namespace: {exc.strerror or exc}") from None
