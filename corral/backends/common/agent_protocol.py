"""The edge's side of the channel to corral-agent inside a container.

One socket per sandbox (a socketpair end the agent inherited as fd 3) carries
length-prefixed frames; see native/agent.c for the agent's side. Commands are
multiplexed by a job id chosen here. This module only speaks the protocol; it
knows nothing about containers.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from corral.api.errors import Conflict, ServerUnavailable

__all__ = ["AgentConnection", "AgentExit", "AgentOutput", "AgentStarted", "ExecOrder", "IpcCounts", "TreeWalk"]

T_EXEC, T_STDIN, T_SIGNAL, T_PING, T_KILL_ALL, T_RESIZE = 1, 2, 3, 4, 5, 6
T_STARTED, T_STDOUT, T_STDERR, T_EXIT, T_ERROR, T_PONG, T_HELLO = 10, 11, 12, 13, 14, 15, 20
T_IPC_QUERY, T_IPC_COUNTS, T_FIND, T_FOUND, T_IDENTIFY = 31, 32, 33, 34, 35
F_TIMED_OUT, F_OUT_TRUNC, F_ERR_TRUNC, F_WALK_CUT, F_WALKED, F_IPC_ALONE = 1, 2, 4, 8, 16, 32
_TOOL_FLAGS = {"": 0, "sandbox": 2, "guest": 2 | 4}  # EXEC flags: run the tool binary by fd; skip the chroot
_X_TERMINAL = 8  # EXEC flag: a pseudo-terminal for the command; u16 rows, u16 cols follow the strings
_X_WALK_AFTER = 16  # EXEC flag: a walk (FIND's payload) once the command exited; after the terminal's size
_X_QUIET_START = 32  # EXEC flag: no STARTED frame (an agent before it sends one anyway: events() then yields it)
_X_IPC_AFTER = 64  # EXEC flag: IPC counts on the exit if the agent (the sandbox's init) has no process left
_IPC_COUNTS = struct.Struct("<III")
AGENT_VERSION = 3  # 2: terminals; 3: IDENTIFY
_AGENT_VERSIONS = frozenset({1, 2, 3})  # agents an edge still talks to (one started by an older build keeps running)
_TERMINAL_SIZE = struct.Struct("<HH")
_HEADER = struct.Struct("<IBI")
_EXEC_FIXED = struct.Struct("<IIQII")
_MAX_FRAME = 16 << 20
_STREAM_FRAMES = frozenset({T_STDOUT, T_STDERR, T_FOUND})  # byte streams: their frames' payloads concatenate


@dataclass(frozen=True)
class TreeWalk:
    """What FIND walks: every non-directory at or below each of ``paths`` (relative to ``root``), at most
    ``cap_bytes`` of NUL-terminated names."""

    root: str
    paths: tuple[str, ...]
    cap_bytes: int

    def encode(self) -> bytes:
        strings = (self.root, *self.paths)
        if any("\0" in text for text in strings):
            raise ValueError("NUL byte in a path")
        return struct.pack("<I", self.cap_bytes) + b"".join(s.encode() + b"\0" for s in strings)


@dataclass(frozen=True)
class ExecOrder:
    """What the agent needs to start one command (already resolved by the edge)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str
    timeout_ms: int
    output_cap_bytes: int
    has_stdin: bool
    tool: str = ""  # guest agents: "sandbox" runs the project's busybox in the sandbox's root, "guest" outside it
    terminal: tuple[int, int] | None = None  # (rows, cols): the command runs on a pseudo-terminal
    walk_after: TreeWalk | None = None  # the agent walks this once the command exited (AgentExit.walked)
    announce_start: bool = True  # False: no AgentStarted (one frame, and a wakeup of the edge, fewer per command)
    ipc_after: bool = False  # AgentExit.ipc_alone, when the sandbox has no other process by then

    def encode(self) -> bytes:
        strings = [self.user, self.cwd, *self.argv, *(f"{k}={v}" for k, v in self.env.items())]
        for text in strings:
            if "\0" in text:
                raise ValueError("NUL byte in command, environment, cwd or user")
        flags = (1 if self.has_stdin else 0) | _TOOL_FLAGS[self.tool] | (_X_TERMINAL if self.terminal else 0)
        fixed = _EXEC_FIXED.pack(
            flags
            | (_X_WALK_AFTER if self.walk_after else 0)
            | (0 if self.announce_start else _X_QUIET_START)
            | (_X_IPC_AFTER if self.ipc_after else 0),
            self.timeout_ms,
            self.output_cap_bytes,
            len(self.argv),
            len(self.env),
        )
        size = _TERMINAL_SIZE.pack(*self.terminal) if self.terminal else b""
        walk = self.walk_after.encode() if self.walk_after else b""
        return fixed + b"".join(s.encode() + b"\0" for s in strings) + size + walk


@dataclass(frozen=True)
class AgentStarted:
    pid: int


@dataclass(frozen=True)
class AgentOutput:
    stream: str  # "stdout" | "stderr"
    data: bytes


@dataclass(frozen=True)
class AgentExit:
    exit_code: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    walked: tuple[list[str], bool] | None = None  # ExecOrder.walk_after's names and whether its cap cut them short
    ipc_alone: IpcCounts | None = None  # ExecOrder.ipc_after: counted with the agent alone in the sandbox


@dataclass(frozen=True)
class _Found:
    """Names of an EXEC's walk (FOUND), NUL-terminated; the exit that follows carries them (AgentExit.walked)."""

    names: bytes


@dataclass(frozen=True)
class IpcCounts:
    """SysV IPC objects in the sandbox's IPC namespace (0xFFFFFFFF: the agent could not tell)."""

    shm_segments: int
    message_queues: int
    semaphore_sets: int


AgentEvent = AgentStarted | AgentOutput | AgentExit
_Answer = AgentEvent | IpcCounts | _Found


@dataclass
class _Job:
    queue: asyncio.Queue[_Answer | Exception] = field(default_factory=asyncio.Queue)


class _FrameReader(asyncio.Protocol):
    """Cuts the agent's byte stream into frames as it arrives and hands each to ``on_frame`` in the same loop
    iteration: no reader task between the socket and a command's queue (one wake-up a frame fewer than a
    StreamReader's). Consecutive byte-stream frames of one kind and job that arrive together (a command's output,
    a walk's names) are handed on as one: the agent sends a frame per pipe read, a few KiB each, and every frame
    costs the edge a decode, a queue hand-off and a record (execs printing 512 KiB, counted: one client, 8,325
    frames read and 6,013 handed on; eight at once, 34,872 and 8,292).
    Also the writing side's flow control (``drained``)."""

    def __init__(
        self, on_frame: Callable[[int, int, bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._pending = bytearray()  # the start of a frame whose rest has not arrived
        self._needed = 0  # bytes ``_pending`` must hold before a frame in it can be whole
        self._transport: asyncio.Transport | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport

    def data_received(self, data: bytes) -> None:
        pending = self._pending
        if pending:
            pending += data
            if len(pending) < self._needed:
                return  # a large frame arriving piece by piece: copied once, when whole
            data = bytes(pending)
            pending.clear()
        offset, end = 0, len(data)
        view = memoryview(data)
        held: list[memoryview] = []  # payloads of consecutive stream frames of (held_kind, held_job)
        held_kind = held_job = -1
        while end - offset >= _HEADER.size:
            total, kind, job_id = _HEADER.unpack_from(data, offset)
            if total < 5 or total > _MAX_FRAME:
                self._on_lost(ConnectionError(f"bad frame length {total} from agent"))
                if self._transport is not None:
                    self._transport.abort()
                return
            if end - offset < 4 + total:
                self._needed = 4 + total
                break
            payload = view[offset + _HEADER.size : offset + 4 + total]
            offset += 4 + total
            if held and (kind, job_id) == (held_kind, held_job):
                held.append(payload)
                continue
            if held:
                self._on_frame(held_kind, held_job, b"".join(held))
                held = []
            if kind in _STREAM_FRAMES:
                held, held_kind, held_job = [payload], kind, job_id
            else:
                self._on_frame(kind, job_id, bytes(payload))
        else:
            self._needed = _HEADER.size
        if held:
            self._on_frame(held_kind, held_job, b"".join(held))
        if offset < end:
            pending += view[offset:]

    def eof_received(self) -> bool:
        return False  # the agent closed its end: so do we (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)
        self.resume_writing()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def drained(self) -> None:
        """Returns once the transport's write buffer is below its high-water mark (or the connection is gone)."""
        if self._write_paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter


class AgentConnection:
    """An open channel to one agent; many commands may run at once over it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = _FrameReader(self._on_frame, self._on_lost)
        self._transport: asyncio.Transport | None = None
        self._greeting: asyncio.Future[tuple[int, int, bytes]] | None = None
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self.agent_pid: int | None = None
        self.agent_version = AGENT_VERSION  # what the agent said in its hello
        self._finds: bool | None = None  # does the agent walk trees itself (FIND)? Learned on first use
        self.last_exec_id: int | None = None  # the job of the last EXEC sent: a walk at an earlier one's exit is stale
        self.ipc_at_exit = False  # ExecOrder.ipc_after for the commands run from now on (AgentCommand asks)
        self._ipc_alone: IpcCounts | None = None  # see ipc_when_alone
        self.closed = asyncio.Event()

    async def start(self, hello_timeout_s: float, *, ping: bool = False) -> None:
        """Open the stream and wait for the agent's hello (it proves the agent runs).

        ``ping``: also send a ping and take its pong as the greeting. A guest
        agent greets each time it sees the host connect, but a quick reconnect
        can pass unseen; the ping always gets an answer."""
        loop = asyncio.get_running_loop()
        self._greeting = loop.create_future()
        self._sock.setblocking(False)
        self._transport, _ = await loop.create_unix_connection(lambda: self._reader, sock=self._sock)
        if ping:
            self._transport.write(_HEADER.pack(5, T_PING, 0))
        try:
            kind, _job_id, payload = await asyncio.wait_for(self._greeting, hello_timeout_s)
        except TimeoutError as exc:
            self.close()
            raise ServerUnavailable(f"sandbox agent did not start within {hello_timeout_s:.0f}s") from exc
        except ConnectionError as exc:  # not a timeout: said as one, a stopped sandbox read as a slow start
            self.close()
            raise ServerUnavailable(
                "sandbox agent closed its connection before its hello (the sandbox stopped?)"
            ) from exc
        if ping and kind == T_PONG:
            return
        if kind != T_HELLO or len(payload) < 8:
            self.close()
            raise ServerUnavailable("sandbox agent sent an unexpected greeting")
        version, self.agent_pid = struct.unpack_from("<II", payload)
        if version not in _AGENT_VERSIONS:
            self.close()
            raise ServerUnavailable(
                f"sandbox agent speaks version {version}, edge expects one of {sorted(_AGENT_VERSIONS)}"
            )
        self.agent_version = version

    def _on_frame(self, kind: int, job_id: int, payload: bytes) -> None:
        greeting = self._greeting
        if greeting is not None and not greeting.done():
            greeting.set_result((kind, job_id, payload))  # the first frame: a hello, or the pong of start's ping
            return
        answer = self._decode(kind, payload)
        if isinstance(answer, AgentExit) and answer.ipc_alone is not None and job_id == self.last_exec_id:
            self._ipc_alone = answer.ipc_alone  # no EXEC sent since: nothing in the sandbox ran after the count
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.queue.put_nowait(answer)
        if kind in (T_EXIT, T_ERROR, T_PONG, T_IPC_COUNTS):
            self._jobs.pop(job_id, None)

    def _on_lost(self, exc: Exception | None) -> None:
        greeting = self._greeting
        if greeting is not None and not greeting.done():
            greeting.set_exception(exc if isinstance(exc, ConnectionError) else ConnectionError("agent closed"))
        self._fail_all(ServerUnavailable("lost the connection to the sandbox agent (the sandbox stopped?)"))

    @staticmethod
    def _decode(kind: int, payload: bytes) -> _Answer | Exception:
        if kind == T_STARTED:
            return AgentStarted(pid=struct.unpack_from("<I", payload)[0])
        if kind == T_STDOUT:
            return AgentOutput("stdout", payload)
        if kind == T_STDERR:
            return AgentOutput("stderr", payload)
        if kind == T_EXIT:
            code, flags = struct.unpack_from("<iB", payload)
            walked: tuple[list[str], bool] | None = ([], bool(flags & F_WALK_CUT)) if flags & F_WALKED else None
            alone = flags & F_IPC_ALONE and len(payload) >= 5 + _IPC_COUNTS.size
            return AgentExit(code, bool(flags & F_TIMED_OUT), bool(flags & F_OUT_TRUNC), bool(flags & F_ERR_TRUNC),
                             walked,  # its names: from the FOUND frames, in run()
                             IpcCounts(*_IPC_COUNTS.unpack_from(payload, 5)) if alone else None)  # fmt: skip
        if kind == T_FOUND:
            return _Found(payload)
        if kind == T_ERROR:
            return Conflict(payload.decode(errors="replace"))
        if kind == T_PONG:
            return AgentExit(0, False, False, False)
        if kind == T_IPC_COUNTS and len(payload) >= _IPC_COUNTS.size:
            return IpcCounts(*_IPC_COUNTS.unpack_from(payload))
        return ServerUnavailable(f"unexpected frame type {kind} from the sandbox agent")

    def _fail_all(self, error: Exception) -> None:
        for job in self._jobs.values():
            job.queue.put_nowait(error)
        self._jobs.clear()
        self.closed.set()

    def _send(self, kind: int, job_id: int, payload: bytes = b"") -> None:
        if self._transport is None or self.closed.is_set():
            raise ServerUnavailable("the connection to the sandbox agent is closed")
        if kind == T_EXEC:
            self.last_exec_id, self._ipc_alone = job_id, None
        self._transport.write(_HEADER.pack(5 + len(payload), kind, job_id) + payload)

    def new_job_id(self) -> int:
        return next(self._ids)

    async def run(self, job_id: int, order: ExecOrder, stdin: bytes | None = None) -> AsyncIterator[AgentEvent]:
        """Start a command as ``job_id`` and yield its events until (and including) its exit."""
        if order.terminal and self.agent_version < 2:
            raise Conflict("this sandbox's agent predates terminals (it was started by an older Corral): recreate it")
        job = _Job()
        self._jobs[job_id] = job
        found = bytearray()
        try:
            self._send(T_EXEC, job_id, order.encode())
            if order.has_stdin:
                for offset in range(0, len(stdin or b""), 1 << 20):
                    self._send(T_STDIN, job_id, (stdin or b"")[offset : offset + (1 << 20)])
                if stdin is not None:
                    self._send(T_STDIN, job_id)
            await self._reader.drained()
            while True:
                event = await job.queue.get()
                if isinstance(event, Exception):
                    raise event
                assert not isinstance(event, IpcCounts)
                if isinstance(event, _Found):
                    found += event.names
                    continue
                if isinstance(event, AgentExit) and event.walked is not None:
                    names = [name.decode(errors="replace") for name in found.split(b"\0") if name]
                    event = replace(event, walked=(names, event.walked[1]))
                yield event
                if isinstance(event, AgentExit):
                    return
        finally:
            self._jobs.pop(job_id, None)

    def write_stdin(self, job_id: int, data: bytes) -> None:
        """Feed a running command's stdin; empty data closes it."""
        self._send(T_STDIN, job_id, data)

    def signal(self, job_id: int, signo: int) -> None:
        self._send(T_SIGNAL, job_id, struct.pack("<I", signo))

    def resize(self, job_id: int, rows: int, cols: int) -> None:
        """Set a terminal command's window size (its foreground programs get SIGWINCH)."""
        self._send(T_RESIZE, job_id, _TERMINAL_SIZE.pack(rows, cols))

    async def _ask(self, kind: int, payload: bytes = b"", *, probe: bool = False) -> _Answer | None:
        """Send a request that the agent answers with one frame; return that answer. ``probe``: a ping behind it
        tells whether the agent knows the request; None if it does not (it ignored it)."""
        job_id = self.new_job_id()
        job = self._jobs[job_id] = _Job()
        try:
            if probe:
                if not await self._send_probed(kind, job_id, job, payload):
                    return None
            else:
                self._send(kind, job_id, payload)
            event = await job.queue.get()
            if isinstance(event, Exception):
                raise event
            return event
        finally:
            self._jobs.pop(job_id, None)

    async def find(self, root: str, paths: Sequence[str], cap_bytes: int) -> tuple[list[str], bool] | None:
        """Every non-directory at or below each of ``paths`` (relative to ``root``; symlinks not followed), named
        relative to ``root``, walked by the agent itself (no process started); and whether its byte cap or time
        budget cut the list short. None if the agent predates this request: it ignores it and answers the ping
        sent behind it first (frames are handled in order), which is learned once per connection."""
        if self._finds is False:
            return None
        request = TreeWalk(root, tuple(paths), cap_bytes).encode()
        find_id = self.new_job_id()
        job = self._jobs[find_id] = _Job()
        try:
            if self._finds is None:
                self._finds = await self._send_probed(T_FIND, find_id, job, request)
                if not self._finds:
                    return None
            else:
                self._send(T_FIND, find_id, request)
            names = bytearray()
            while True:
                event = await job.queue.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, AgentOutput):
                    names += event.data
                elif isinstance(event, AgentExit):
                    return [
                        name.decode(errors="replace") for name in names.split(b"\0") if name
                    ], event.stdout_truncated
        finally:
            self._jobs.pop(find_id, None)

    async def _send_probed(self, kind: int, job_id: int, job: _Job, payload: bytes) -> bool:
        """Send a request as ``job_id`` (``job``, registered) with a ping behind it; whether the agent knows the
        request: one that predates it ignores it, and frames are handled in order, so it has answered the request
        (at least its first frame) by the time the pong comes, or never will."""
        probe_id = self.new_job_id()
        probe = self._jobs[probe_id] = _Job()
        try:
            self._send(kind, job_id, payload)
            self._send(T_PING, probe_id)
            pong = await probe.queue.get()
            if isinstance(pong, Exception):
                raise pong
            return not job.queue.empty()
        finally:
            self._jobs.pop(probe_id, None)

    async def identify(self, hostname: str, entropy: bytes) -> bool:
        """Give a restored guest its own hostname and credit ``entropy`` to its kernel's RNG, done by the agent
        itself (no process started: a new binary costs ~100 ms in a restored TCG guest). False if the agent
        predates the request (version 3), which then changed nothing."""
        if "\0" in hostname:
            raise ValueError("NUL byte in a hostname")
        return await self._ask(T_IDENTIFY, hostname.encode() + b"\0" + entropy, probe=True) is not None

    async def kill_all(self) -> None:
        """SIGKILL every process in the sandbox except the agent; returns once the agent has sent the signal."""
        await self._ask(T_KILL_ALL)

    def ipc_when_alone(self) -> IpcCounts | None:
        """The IPC counts an EXEC's exit carried (ExecOrder.ipc_after), if no EXEC was sent since: the agent took
        them with no other process in the sandbox, and only an EXEC starts one, so they still hold (what
        ``ipc_counts`` would answer, without its round trip)."""
        return None if self.closed.is_set() else self._ipc_alone

    async def ipc_counts(self) -> IpcCounts:
        """The SysV IPC objects of the sandbox (only the agent, inside its IPC namespace, can see them)."""
        answer = await self._ask(T_IPC_QUERY)
        if not isinstance(answer, IpcCounts):
            raise ServerUnavailable(f"the sandbox agent answered an IPC query with {answer!r}")
        return answer

    async def let_go(self, timeout_s: float) -> None:
        """Close our sending side and wait until the agent has closed its end (gVisor: before a checkpoint, which
        must hold no host socket)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write_eof()
        try:
            await asyncio.wait_for(self.closed.wait(), timeout_s)
        except TimeoutError:
            raise ServerUnavailable(f"the sandbox agent did not let go of its socket within {timeout_s:.0f}s") from None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        else:
            self._sock.close()
        self._on_lost(None)
