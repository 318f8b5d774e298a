"""The in-process edge: one node's sandboxes, their commands and admission.

It owns the backend, decides whether this node can take another sandbox
(CPU and memory overcommit), merges per-sandbox defaults into each command,
keeps background commands and their output, and notices sandboxes that stop
by themselves. File operations run in worker threads because a tar of a
large tree blocks.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import heapq
import io
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from prometheus_client.core import Metric

from corral import tracing
from corral.api.errors import (
    CapacityExhausted,
    InternalError,
    InvalidRequest,
    NotFound,
    SandboxGone,
    ServerUnavailable,
)
from corral.api.models import (
    CommandInfo,
    EdgeLoad,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    NetworkRule,
    NodeStats,
)
from corral.backends.base import (
    Backend,
    Capability,
    Checkpointing,
    CommandEvent,
    CommandExit,
    CommandOutput,
    CommandSpec,
    CommandStarted,
    FileTree,
    RunningCommand,
    SandboxSpec,
    checkpoints_of,
    find_offer,
    split_offer,
)
from corral.backends.common.network import to_allow_rules
from corral.backends.vm.memory import ksm_merged_bytes
from corral.edge.host_readings import HostReadings, read_host
from corral.edge.metrics import CountedEvents, EdgeMetrics
from corral.edge.protocol import AuditedExec, EdgeEvents
from corral.guard.audit import classify_changes

__all__ = ["LocalEdge", "NodeCapacity"]

log = logging.getLogger(__name__)
R = TypeVar("R")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_FINISHED_COMMANDS_KEPT = 256
ADOPT_CONCURRENCY = 16  # sandboxes re-attached at once after a restart (CORRAL_ADOPT_CONCURRENCY)
_HOUSEKEEPING_INTERVAL_S = 1.0
_PRESSURE_PAUSES_PER_ROUND = 8  # sandboxes paused per housekeeping round while memory is short
_NETWORK_AUDIT_EVERY = 5  # rounds in which every sandbox's denied-packet counters are looked at once
_NETWORK_AUDIT_LISTINGS = 100  # a round's counter listings at most (~0.6 ms of CPU each)
_DISK_FULL_FRACTION = 0.95
# A command whose agent connection dropped waits this long for the sandbox's watcher to end the sandbox, so its
# client hears that the sandbox ended (410, with the reason) rather than of a lost connection (a crun kill and
# delete take tens of milliseconds; the agent is the sandbox's init, so its end is the sandbox's).
_AGENT_LOSS_SETTLE_S = 5.0
ENDED_BY_ITSELF = ("the sandbox's init process (its Corral agent) exited or was killed, and every process in the "
                   "sandbox ended with it")  # fmt: skip
_ADMISSION_READING_MAX_AGE_S = 0.5  # reading /proc costs ~0.2 ms: a burst's admissions share one reading


@dataclass(frozen=True)
class NodeCapacity:
    cpu: float
    memory_mb: int
    cpu_overcommit: float
    memory_overcommit: float
    max_file_bytes: int
    memory_reserve_mb: int = 1024  # below this much MemAvailable the node refuses new sandboxes
    memory_full_pressure_pct: float = 10.0  # ... and above this memory PSI "full" avg10 (the node thrashes)
    pressure_pause_idle_s: float = 30.0  # under pressure, sandboxes idle this long are paused (memory reclaimed)
    labels: dict[str, str] = field(default_factory=dict)  # reported in the load; creates select nodes by them
    disk_floor_mb: int = 0  # below this much free space on the data dir's filesystem the node refuses new sandboxes
    data_dir: Path | None = None
    output_buffer_bytes: int = 64 << 20  # background commands' output kept per sandbox (until read or evicted)


@dataclass
class _Command:
    command_id: str
    cmd: str | list[str]
    running: RunningCommand
    started_at: float
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    exit: CommandExit | None = None
    task: asyncio.Task[None] | None = None
    terminal: tuple[int, int] | None = None  # (rows, cols) it was started with, for a pty command
    dropped: set[str] = field(default_factory=set)  # streams cut here: the sandbox's output buffer was full
    lost: ServerUnavailable | None = None  # its agent connection dropped while it ran

    def info(self) -> CommandInfo:
        return CommandInfo(command_id=self.command_id, cmd=self.cmd, running=self.exit is None, result=self.result())

    def result(self) -> ExecResult:
        end = self.exit
        return ExecResult(
            exit_code=end.exit_code if end else None,
            stdout=self.stdout.decode(errors="replace"),
            stderr=self.stderr.decode(errors="replace"),
            timed_out=bool(end and end.timed_out),
            oom_killed=bool(end and end.oom_killed),
            stdout_truncated=bool(end and end.stdout_truncated) or "stdout" in self.dropped,
            stderr_truncated=bool(end and end.stderr_truncated) or "stderr" in self.dropped,
            duration_ms=(time.monotonic() - self.started_at) * 1000,
            command_id=self.command_id,
        )


class _Commitments:
    """CPU and memory promised to admitted sandboxes (starting or running), kept as running sums."""

    def __init__(self) -> None:
        self._specs: dict[str, SandboxSpec] = {}
        self.cpu = 0.0
        self.memory_mb = 0

    def __len__(self) -> int:
        return len(self._specs)

    def add(self, spec: SandboxSpec) -> None:
        if spec.sandbox_id not in self._specs:
            self._specs[spec.sandbox_id] = spec
            self.cpu += spec.cpu
            self.memory_mb += spec.memory_mb

    def remove(self, sandbox_id: str) -> None:
        spec = self._specs.pop(sandbox_id, None)
        if spec is not None:
            self.cpu -= spec.cpu
            self.memory_mb -= spec.memory_mb


@dataclass
class _Sandbox:
    spec: SandboxSpec
    commands: dict[str, _Command] = field(default_factory=dict)
    next_command: int = 1
    watcher: asyncio.Task[None] | None = None
    owner: tuple[int, int] | None = None  # uid, gid of spec.user, looked up on first file write
    paused: bool = False
    reported_paths: set[str] = field(default_factory=set)  # protected paths already in the audit log
    pid_limit_hits: int = 0
    denied_packets: int = 0
    disk_full: bool = False
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # pause and resume one at a time

    def busy(self) -> bool:
        return any(command.exit is None for command in self.commands.values())

    def kept_output_bytes(self) -> int:
        """What background commands' output this edge holds for the sandbox."""
        return sum(len(c.stdout) + len(c.stderr) for c in self.commands.values() if c.task is not None)


def _handover_settings(spec: SandboxSpec) -> dict[str, Any]:
    """The settings a warm sandbox takes from its claim (the edge applies them per command, not at start; a
    network's allowlist replaces the closed one it started with)."""
    return {"image": spec.image, "env": spec.env, "cwd": spec.cwd, "user": spec.user, "idle_pause_s": spec.idle_pause_s,
            "pool_member": spec.pool_member, "network": spec.network}  # fmt: skip


def _lookup_owner(tree: FileTree, user: str) -> tuple[int, int]:
    """The uid and gid that ``user`` (name, uid or uid:gid) has in the sandbox's own /etc/passwd."""
    uid_text, _, gid_text = user.partition(":")
    if uid_text.isdigit():
        return int(uid_text), int(gid_text) if gid_text.isdigit() else int(uid_text)
    try:
        passwd = tree.read("/etc/passwd", max_bytes=1 << 20).decode(errors="replace")
    except NotFound:
        passwd = ""
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == user and fields[2].isdigit() and fields[3].isdigit():
            return int(fields[2]), int(fields[3])
    raise InvalidRequest(f"user {user!r} is not in the sandbox's /etc/passwd")


class LocalEdge:
    """An edge living in the gateway's process (the embedded single-node default)."""

    def __init__(
        self,
        edge_id: str,
        backend: Backend,
        capacity: NodeCapacity,
        events: EdgeEvents,
        *,
        host_reader: Callable[[], HostReadings] = read_host,
        adopt_concurrency: int = ADOPT_CONCURRENCY,
    ) -> None:
        """``host_reader``: the node's memory and pressure (simulated nodes sharing one host share one).
        ``adopt_concurrency``: sandboxes re-attached at once after a restart (``adopt``)."""
        self.edge_id = edge_id
        self._adopt_concurrency = adopt_concurrency
        self._read_host = host_reader
        self._backend = backend
        self._capacity = capacity
        self.metrics = EdgeMetrics(edge_id)
        self._events = CountedEvents(events, self.metrics)  # what it does on its own, counted where it happens
        self._sandboxes: dict[str, _Sandbox] = {}
        self._starting: set[str] = set()
        self._committed = _Commitments()
        self._cancelled: set[str] = set()  # killed while starting: destroyed once the start returns
        self._housekeeping: asyncio.Task[None] | None = None
        self._host_reading: tuple[float, HostReadings] | None = None  # (monotonic time read, reading)
        self._audit_cursor = 0  # where the next round's network audit starts in the sandboxes' order

    async def start(self) -> None:
        self._housekeeping = asyncio.get_running_loop().create_task(self._keep_house())

    async def _keep_house(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING_INTERVAL_S)
            try:
                self._backend.housekeeping()
                await asyncio.to_thread(self._backend.refresh_network)  # host names in egress rules, when due
                for sandbox_id, kind, severity, detail in self._backend.kernel_events():
                    self._events.audit(sandbox_id, kind, severity, detail)
                await self._pause_idle()
                await self._relieve_pressure()
                await self._audit_network()
            except Exception:
                log.exception("edge %s: housekeeping failed; retrying", self.edge_id)

    # -- admission and lifecycle -------------------------------------------

    async def load(self) -> EdgeLoad:
        offers = self._backend.offers()
        kinds = [split_offer(key) for key in offers]
        return EdgeLoad(
            edge_id=self.edge_id,
            node_cpu=self._capacity.cpu,
            node_memory_mb=self._capacity.memory_mb,
            sandboxes=len(self._committed),
            cpu_committed=self._committed.cpu,
            cpu_capacity=self._capacity.cpu * self._capacity.cpu_overcommit,
            memory_committed_mb=self._committed.memory_mb,
            memory_capacity_mb=int(self._capacity.memory_mb * self._capacity.memory_overcommit),
            backends=sorted({backend for backend, _ in kinds}),
            runtimes=sorted({runtime for _, runtime in kinds if runtime is not None}),
            offers={key: sorted(capabilities) for key, capabilities in offers.items()},
            labels=self._capacity.labels,
        )

    async def stats(self) -> NodeStats:
        host = self._read_host()
        counts: dict[str, dict[str, int]] = {}
        resident = 0
        for sandbox_id, sandbox in list(self._sandboxes.items()):
            state = "paused" if sandbox.paused else "running"
            per_backend = counts.setdefault(sandbox.spec.backend, {})
            per_backend[state] = per_backend.get(state, 0) + 1
            resident += self._backend.resident_bytes(sandbox_id)
        cap = self._capacity
        return NodeStats(
            edge_id=self.edge_id,
            sandboxes=counts,
            cpu_cores=cap.cpu,
            cpu_committed=self._committed.cpu,
            cpu_overcommit=self._committed.cpu / cap.cpu,
            cpu_capacity=cap.cpu * cap.cpu_overcommit,
            load_1m=host.load_1m,
            memory_total_mb=host.memory_total_mb,
            memory_available_mb=host.memory_available_mb,
            memory_committed_mb=self._committed.memory_mb,
            memory_capacity_mb=int(cap.memory_mb * cap.memory_overcommit),
            memory_resident_mb=resident / (1 << 20),
            memory_reclaimed_mb=host.swap_used_mb,
            memory_merged_mb=ksm_merged_bytes() / (1 << 20),
            swap_total_mb=host.swap_total_mb,
            pressure={
                "cpu_some": host.cpu_some_avg10,
                "memory_some": host.memory_some_avg10,
                "memory_full": host.memory_full_avg10,
                "io_some": host.io_some_avg10,
            },  # fmt: skip
            refusing=pressure_refusal(self._capacity, host),
        )

    async def _relieve_pressure(self) -> None:
        """When memory runs short, pause (and so reclaim) the longest-idle sandboxes first."""
        host = self._read_host()
        if not memory_is_short(self._capacity, host):
            return
        now = time.monotonic()
        idle = sorted(
            (s for s in self._sandboxes.values()
             if not s.paused and not s.busy() and now - s.last_active >= self._capacity.pressure_pause_idle_s),
            key=lambda s: s.last_active,
        )  # fmt: skip
        why = f"to relieve memory pressure ({host.memory_available_mb} MiB available)"
        await self._pause_all(idle[:_PRESSURE_PAUSES_PER_ROUND], lambda _: why)

    async def _pause_all(self, sandboxes: list[_Sandbox], why: Callable[[_Sandbox], str]) -> None:
        """Pause each (best effort), log why and tell the service."""
        for sandbox in sandboxes:
            sandbox_id = sandbox.spec.sandbox_id
            try:
                await self.pause(sandbox_id)
            except Exception:
                log.exception("edge %s: could not pause sandbox %s", self.edge_id, sandbox_id)
                continue
            log.info("sandbox %s paused %s", sandbox_id, why(sandbox))
            self._events.paused(sandbox_id, time.time())

    def _disk_refusal(self) -> str | None:
        """Why the node should take no new sandbox: its data disk is under the floor (naming the biggest
        writers, the sandboxes to kill first), or None. One statvfs: cheaper than the host reading."""
        cap = self._capacity
        if not cap.disk_floor_mb or cap.data_dir is None:
            return None
        st = os.statvfs(cap.data_dir)
        free_mb = st.f_bavail * st.f_frsize >> 20
        if free_mb >= cap.disk_floor_mb:
            return None
        usages = ((usage[0], sandbox_id) for sandbox_id in self._sandboxes
                  if (usage := self._backend.disk_usage(sandbox_id)) is not None)  # fmt: skip
        writers = ", ".join(f"{sandbox_id} ({used >> 20} MiB)" for used, sandbox_id in heapq.nlargest(3, usages))
        return (f"the data disk is short: {free_mb} MiB free on {cap.data_dir}, {cap.disk_floor_mb} MiB kept in "
                f"reserve; biggest writers: {writers or 'none of its sandboxes'}")  # fmt: skip

    async def _admit(self, spec: SandboxSpec) -> None:
        refusal = pressure_refusal(self._capacity, self._recent_host_reading()) or self._disk_refusal()
        if refusal is not None:
            raise CapacityExhausted(
                f"node {self.edge_id} refuses new sandboxes: {refusal}; retry later, or pause or kill idle ones"
            )
        if spec.cpu > self._capacity.cpu:
            raise InvalidRequest(f"cpu={spec.cpu} is more than this node has ({self._capacity.cpu:g} cores)")
        if spec.memory_mb > self._capacity.memory_mb:
            raise InvalidRequest(
                f"memory_mb={spec.memory_mb} is more than this node has ({self._capacity.memory_mb} MiB)"
            )
        # The committed resources against capacity, as load() reports them; not load() itself, whose offers look
        # each runtime up on PATH (shutil.which for each, on every create).
        cap, committed = self._capacity, self._committed
        cpu_capacity, memory_capacity_mb = cap.cpu * cap.cpu_overcommit, int(cap.memory_mb * cap.memory_overcommit)
        if committed.cpu + spec.cpu > cpu_capacity or committed.memory_mb + spec.memory_mb > memory_capacity_mb:
            raise CapacityExhausted(
                f"node {self.edge_id} is full ({len(committed)} sandboxes, {committed.cpu:g}/{cpu_capacity:g} cpu, "
                f"{committed.memory_mb}/{memory_capacity_mb} MiB committed): retry later or kill sandboxes"
            )
        committed.add(spec)

    def _recent_host_reading(self) -> HostReadings:
        now = time.monotonic()
        if self._host_reading is None or now - self._host_reading[0] > _ADMISSION_READING_MAX_AGE_S:
            self._host_reading = (now, self._read_host())
        return self._host_reading[1]

    async def create(self, spec: SandboxSpec) -> str | None:
        started_s = time.perf_counter()
        with tracing.span("corral.edge.admission", sandbox_id=spec.sandbox_id, edge_id=self.edge_id):
            await self._admit(spec)
        self._starting.add(spec.sandbox_id)
        try:
            with tracing.span("corral.edge.backend_start", sandbox_id=spec.sandbox_id, backend=spec.backend,
                              edge_id=self.edge_id):  # fmt: skip
                note = await self._backend.create(spec)
            if spec.sandbox_id in self._cancelled:
                await self._backend.destroy(spec.sandbox_id)
                raise SandboxGone(f"sandbox {spec.sandbox_id} was killed while it was starting")
        except BaseException:
            self._committed.remove(spec.sandbox_id)
            raise
        finally:
            self._starting.discard(spec.sandbox_id)
            self._cancelled.discard(spec.sandbox_id)
        self._track(spec)
        self.metrics.started(spec.backend, time.perf_counter() - started_s)
        return note

    async def metric_families(self) -> list[Metric]:
        return self.metrics.families()

    def _track(self, spec: SandboxSpec) -> _Sandbox:
        self._committed.add(spec)
        sandbox = _Sandbox(spec)
        sandbox.watcher = asyncio.get_running_loop().create_task(self._watch(spec.sandbox_id))
        self._sandboxes[spec.sandbox_id] = sandbox
        return sandbox

    async def _watch(self, sandbox_id: str) -> None:
        reason = await self._backend.wait_ended(sandbox_id)
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return
        self._committed.remove(sandbox_id)
        log.warning("sandbox %s stopped by itself (%s)", sandbox_id, reason)
        await self._backend.destroy(sandbox_id)
        self._events.ended(sandbox_id, reason, ENDED_BY_ITSELF)

    async def _events_or_end(self, sandbox: _Sandbox, command: _Command) -> AsyncIterator[CommandEvent]:
        """The command's events; if its agent connection drops, SandboxGone once the sandbox has ended."""
        try:
            async for event in command.running.events():
                yield event
        except ServerUnavailable as exc:
            await self._agent_lost(sandbox, exc)

    async def _agent_lost(self, sandbox: _Sandbox, exc: ServerUnavailable) -> NoReturn:
        """A command's agent connection dropped: say the sandbox ended if its watcher finds it did (bounded)."""
        if sandbox.watcher is not None:
            await asyncio.wait({sandbox.watcher}, timeout=_AGENT_LOSS_SETTLE_S)
            if sandbox.watcher.done() and sandbox.spec.sandbox_id not in self._sandboxes:
                raise SandboxGone(f"sandbox {sandbox.spec.sandbox_id} ended while the command ran: {ENDED_BY_ITSELF}")
        raise exc

    async def adopt(self, specs: list[SandboxSpec]) -> dict[str, str | None]:
        """Re-attach to the sandboxes a previous server left running, several at a time (each waits on its
        runtime and agent: one at a time, a node of a thousand took minutes to come back; `corral bench
        restart` measures it)."""
        alive: dict[str, str | None] = {}
        room = asyncio.Semaphore(self._adopt_concurrency)

        async def adopt_one(spec: SandboxSpec) -> None:
            async with room:
                state = alive[spec.sandbox_id] = await self._backend.adopt(spec)
            if state is not None:
                self._track(spec).paused = state == "paused"

        for failed in await asyncio.gather(*(adopt_one(spec) for spec in specs), return_exceptions=True):
            if isinstance(failed, BaseException):  # after the others finished: none is left half-adopted
                raise failed
        alive = {spec.sandbox_id: alive[spec.sandbox_id] for spec in specs}  # in the records' order
        for orphan in await self._backend.orphans(set(alive)):
            log.warning("removing container %s that no sandbox record owns", orphan)
            await self._backend.destroy(orphan)
        return alive

    async def claim(self, sandbox_id: str, spec: SandboxSpec) -> None:
        sandbox = self._get(sandbox_id)
        started = sandbox.spec
        if (spec.network is None) != (started.network is None) or (
            dataclasses.replace(spec, **_handover_settings(started)) != started
        ):
            raise InvalidRequest(f"sandbox {sandbox_id} was started with other settings than the claim's")
        sandbox.spec, sandbox.owner, sandbox.last_active = spec, None, time.monotonic()
        if started.pool_member and not spec.pool_member:
            await self._backend.claimed(spec)
        if spec.network is not None and spec.network != started.network:  # started closed: the client's allowlist
            await self._backend.set_network(sandbox_id, spec.network)

    async def sandbox_ids(self) -> set[str]:
        """The sandboxes this edge runs (started; not those still starting)."""
        return set(self._sandboxes) - self._starting

    async def destroy(self, sandbox_id: str) -> None:
        if sandbox_id in self._starting:  # let the start finish, then undo it (see create)
            self._cancelled.add(sandbox_id)
            return
        self._committed.remove(sandbox_id)
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is not None and sandbox.watcher is not None:
            sandbox.watcher.cancel()
        await self._backend.destroy(sandbox_id)

    async def close(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        for sandbox in self._sandboxes.values():
            if sandbox.watcher is not None:
                sandbox.watcher.cancel()
            for command in sandbox.commands.values():
                if command.task is not None:
                    command.task.cancel()
        self._sandboxes.clear()
        self._committed = _Commitments()
        await self._backend.close()

    # -- commands -----------------------------------------------------------

    def _get(self, sandbox_id: str) -> _Sandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"sandbox {sandbox_id} is not running on edge {self.edge_id}")
        return sandbox

    async def _active(self, sandbox_id: str) -> _Sandbox:
        """The sandbox a request is for: resumed first if it was paused (any request resumes it)."""
        sandbox = self._get(sandbox_id)
        sandbox.last_active = time.monotonic()
        if sandbox.paused:
            async with sandbox.lock:
                if sandbox.paused:
                    await self._backend.resume(sandbox_id)
                    sandbox.paused = False
                    self._events.resumed(sandbox_id, time.time())
        return sandbox

    # -- pause and resume ---------------------------------------------------

    async def pause(self, sandbox_id: str, wait_reclaim: bool = False) -> tuple[int, int]:
        sandbox = self._get(sandbox_id)
        async with sandbox.lock:
            result = await self._backend.pause(sandbox_id, wait_reclaim=wait_reclaim)
            sandbox.paused = True
        return result.before_bytes, result.after_bytes

    async def resume(self, sandbox_id: str) -> None:
        sandbox = self._get(sandbox_id)
        async with sandbox.lock:
            if sandbox.paused:
                await self._backend.resume(sandbox_id)
                sandbox.paused = False
        sandbox.last_active = time.monotonic()

    async def _pause_idle(self) -> None:
        now = time.monotonic()
        idle = [
            sandbox for sandbox in self._sandboxes.values()
            if sandbox.spec.idle_pause_s is not None and not sandbox.paused and not sandbox.busy()
            and now - sandbox.last_active >= sandbox.spec.idle_pause_s
        ]  # fmt: skip
        await self._pause_all(idle, lambda sandbox: f"after {now - sandbox.last_active:.0f}s idle")

    def _start(
        self, sandbox: _Sandbox, request: ExecRequest, keep_stdin_open: bool = False, *, announce_start: bool = True
    ) -> _Command:
        spec = sandbox.spec
        argv = ["/bin/sh", "-c", request.cmd] if isinstance(request.cmd, str) else list(request.cmd)
        if not argv or not argv[0]:
            raise InvalidRequest("cmd is empty: give a shell command string or a non-empty argv list")
        env = {"PATH": _DEFAULT_PATH, **spec.env, **request.env}
        terminal = (request.pty.rows, request.pty.cols) if request.pty else None
        if terminal and Capability.TERMINALS not in (
            find_offer(self._backend.offers(), spec.backend, spec.runtime) or ()
        ):
            raise InvalidRequest(f"backend={spec.backend} runs no commands on a terminal: pty is not available")
        if terminal:  # a terminal's input is always open (commands/{id}/stdin); its programs want TERM
            keep_stdin_open = True
            env.setdefault("TERM", "xterm-256color")
        stdin = request.stdin.encode() if request.stdin is not None else (b"" if keep_stdin_open else None)
        command_spec = CommandSpec(
            argv=argv,
            env=env,
            cwd=request.cwd or spec.cwd,
            user=request.user or spec.user,
            timeout_s=request.timeout_s,
            output_cap_bytes=request.output_cap_bytes,
            stdin=stdin,
            terminal=terminal,
            announce_start=announce_start,
        )
        command_id = f"c{sandbox.next_command}"
        sandbox.next_command += 1
        running = self._backend.run(spec.sandbox_id, command_spec)
        command = _Command(command_id, request.cmd, running, time.monotonic(), terminal=terminal)
        sandbox.commands[command_id] = command
        finished = [c for c in sandbox.commands.values() if c.exit is not None]
        for old in finished[: max(0, len(finished) - _FINISHED_COMMANDS_KEPT)]:
            sandbox.commands.pop(old.command_id, None)
        return command

    @staticmethod
    def _record(command: _Command, event: CommandStarted | CommandOutput | CommandExit) -> None:
        if isinstance(event, CommandOutput):
            (command.stdout if event.stream == "stdout" else command.stderr).extend(event.data)
        elif isinstance(event, CommandExit):
            command.exit = event

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        with tracing.span("corral.edge.exec", sandbox_id=sandbox_id, edge_id=self.edge_id) as span:
            sandbox = await self._active(sandbox_id)
            span.set("backend", sandbox.spec.backend)
            command = self._start(sandbox, request, announce_start=False)  # only its exit is read
            try:
                with tracing.span("corral.agent.command", sandbox_id=sandbox_id) as agent:  # to the agent and back
                    async for event in self._events_or_end(sandbox, command):
                        self._record(command, event)
                    result = command.result()
                    if result.exit_code is not None:  # None: it timed out or was killed
                        agent.set("exit_code", result.exit_code)
            finally:
                sandbox.commands.pop(command.command_id, None)
            return result

    async def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncGenerator[ExecEvent, None]:
        sandbox = await self._active(sandbox_id)
        command = self._start(sandbox, request)
        decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in ("stdout", "stderr")}
        try:
            async for event in self._events_or_end(sandbox, command):
                if isinstance(event, CommandStarted):
                    yield ExecEvent(type="started", command_id=command.command_id)
                elif isinstance(event, CommandOutput):
                    text = decoders[event.stream].decode(event.data)
                    if text:
                        yield ExecEvent(type=event.stream, data=text)
                else:
                    command.exit = event
                    for name, decoder in decoders.items():
                        tail = decoder.decode(b"", final=True)
                        if tail:
                            yield ExecEvent(type=name, data=tail)
                    yield ExecEvent(type="exit", command_id=command.command_id, result=command.result())
        finally:
            if command.exit is None:
                command.running.signal(9)  # the client went away: do not leave it running
            sandbox.commands.pop(command.command_id, None)

    async def start_command(self, sandbox_id: str, request: ExecRequest) -> CommandInfo:
        sandbox = await self._active(sandbox_id)
        command = self._start(sandbox, request, keep_stdin_open=True)
        started = asyncio.get_running_loop().create_future()

        async def consume() -> None:
            try:
                async for event in command.running.events():
                    self._record(command, self._within_buffer(sandbox, command, event))
                    if isinstance(event, CommandStarted) and not started.done():
                        started.set_result(None)
            except Exception as exc:  # surfaced to the caller waiting for the start
                if not started.done():
                    started.set_exception(exc)
                elif command.exit is None:
                    command.exit = CommandExit(exit_code=-1)
                    command.lost = exc if isinstance(exc, ServerUnavailable) else None
            finally:
                if not started.done():
                    started.set_result(None)

        command.task = asyncio.get_running_loop().create_task(consume())
        await started
        return command.info()

    def _within_buffer(self, sandbox: _Sandbox, command: _Command, event: CommandEvent) -> CommandEvent:
        """A background command's output, kept within the sandbox's output buffer: finished commands' output
        goes first (oldest first, the command with it), then what does not fit is dropped and flagged truncated."""
        if not isinstance(event, CommandOutput):
            return event
        over = sandbox.kept_output_bytes() + len(event.data) - self._capacity.output_buffer_bytes
        for old in [c for c in sandbox.commands.values() if c.exit is not None and c.task is not None]:
            if over <= 0:
                break
            sandbox.commands.pop(old.command_id, None)
            over -= len(old.stdout) + len(old.stderr)
        if over <= 0:
            return event
        command.dropped.add(event.stream)
        return CommandOutput(event.stream, event.data[: max(0, len(event.data) - over)])

    async def _command(self, sandbox_id: str, command_id: str) -> _Command:
        command = (await self._active(sandbox_id)).commands.get(command_id)
        if command is None:
            raise NotFound(f"no command {command_id} in sandbox {sandbox_id} (only background commands are kept)")
        return command

    async def command(self, sandbox_id: str, command_id: str, wait_s: float) -> CommandInfo:
        command = await self._command(sandbox_id, command_id)
        sandbox = self._get(sandbox_id)
        if command.task is not None and wait_s > 0:
            await asyncio.wait({command.task}, timeout=wait_s)
        if command.lost is not None:
            await self._agent_lost(sandbox, command.lost)
        return command.info()

    async def command_stdin(self, sandbox_id: str, command_id: str, data: bytes) -> None:
        (await self._command(sandbox_id, command_id)).running.write_stdin(data)

    async def command_signal(self, sandbox_id: str, command_id: str, signo: int) -> None:
        (await self._command(sandbox_id, command_id)).running.signal(signo)

    async def command_resize(self, sandbox_id: str, command_id: str, rows: int, cols: int) -> None:
        command = await self._command(sandbox_id, command_id)
        if command.terminal is None:
            raise InvalidRequest(f"command {command_id} was not started with a pty: it has no window to resize")
        command.running.resize(rows, cols)

    async def set_network(self, sandbox_id: str, allow: list[NetworkRule]) -> tuple[str, int, int]:
        await self._active(sandbox_id)
        address = await self._backend.set_network(sandbox_id, to_allow_rules(allow))
        _, egress, ingress = await self.network_status(sandbox_id)
        return address, egress, ingress

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        await self._backend.attach_network_peer(name, netns_path, address)

    async def network_status(self, sandbox_id: str) -> tuple[str | None, int, int]:
        self._get(sandbox_id)
        address, denied = await self._backend.network_status(sandbox_id)
        return address, denied.egress_packets if denied else 0, denied.ingress_packets if denied else 0

    async def exec_audited(self, sandbox_id: str, request: ExecRequest, *, step_files: bool = False) -> AuditedExec:
        since = await self.fs_clock(sandbox_id) if step_files else None
        return await self._audited(sandbox_id, await self.exec(sandbox_id, request), since)

    async def exec_stream_audited(
        self, sandbox_id: str, request: ExecRequest, *, step_files: bool = False
    ) -> AsyncIterator[ExecEvent | AuditedExec]:
        since = await self.fs_clock(sandbox_id) if step_files else None
        # Closed with this one: a caller that leaves the stream kills the command now, not when it is collected.
        async with contextlib.aclosing(self.exec_stream(sandbox_id, request)) as events:
            async for event in events:
                if event.type == "exit" and event.result is not None:
                    yield await self._audited(sandbox_id, event.result, since)
                else:
                    yield event

    async def _audited(self, sandbox_id: str, result: ExecResult, since: float | None) -> AuditedExec:
        """What follows a command's exit in one audited call: the files it changed (since ``since``, when taken)
        and the audit's findings."""
        files = await self.changed_paths(sandbox_id, since) if since is not None else None  # gone: the step fails
        try:
            return AuditedExec(result, await self.audit_after_command(sandbox_id), files)
        except (NotFound, SandboxGone):  # it ended with the command: nothing more to find
            return AuditedExec(result, [], files)

    async def audit_after_command(self, sandbox_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        sandbox = self._get(sandbox_id)
        changed, pid_limit_hits = await self._backend.findings(sandbox_id)
        found: list[tuple[str, str, dict[str, Any]]] = []
        new_paths = [path for path in changed if path not in sandbox.reported_paths]
        sandbox.reported_paths.update(new_paths)
        found += classify_changes(new_paths, sandbox.spec.protected_paths)
        if pid_limit_hits > sandbox.pid_limit_hits:
            found.append(("pids_limit", "warning", {"hits": pid_limit_hits - sandbox.pid_limit_hits,
                                                    "pids_max": sandbox.spec.pids_max}))  # fmt: skip
            sandbox.pid_limit_hits = pid_limit_hits
        usage = self._backend.disk_usage(sandbox_id)
        full = usage is not None and usage[0] >= _DISK_FULL_FRACTION * usage[1]
        if full and not sandbox.disk_full:
            found.append(("disk_full", "warning", {"used_bytes": usage[0], "total_bytes": usage[1]}))  # type: ignore[index]
        sandbox.disk_full = full
        return found

    async def _audit_network(self) -> None:
        """Denied packets of networked sandboxes since the last look become audit events. A round looks at the
        next 1/_NETWORK_AUDIT_EVERY of the sandboxes, so each once every _NETWORK_AUDIT_EVERY rounds, and lists at
        most _NETWORK_AUDIT_LISTINGS networked ones' counters: past 500 networked sandboxes each is looked at less
        often, and the listings' CPU stays ~6% of a core (by count: 10,000 every 5 s would take 1.2 cores)."""
        ids = list(self._sandboxes)
        if not ids:
            return
        start = self._audit_cursor % len(ids)
        visits, visited, listed = -(-len(ids) // _NETWORK_AUDIT_EVERY), 0, 0
        for sandbox_id in ids[start:] + ids[:start]:
            if visited == visits or listed == _NETWORK_AUDIT_LISTINGS:
                break
            visited += 1
            sandbox = self._sandboxes.get(sandbox_id)
            if sandbox is None or sandbox.paused:
                continue
            try:
                address, egress, ingress = await self.network_status(sandbox_id)
            except (NotFound, SandboxGone):
                continue  # ended meanwhile
            except InternalError as exc:  # one sandbox's listing failing must not hold up the others' every round
                log.warning("edge %s: denied packets of %s not read: %s", self.edge_id, sandbox_id, exc)
                listed += 1  # it was tried: it counts toward the round's listings
                continue
            listed += address is not None
            if egress + ingress > sandbox.denied_packets:
                detail = {"packets": egress + ingress - sandbox.denied_packets, "egress_total": egress}
                self._events.audit(sandbox_id, "network_denied", "warning", detail)
                sandbox.denied_packets = egress + ingress
        self._audit_cursor = start + visited

    async def recycle(self, sandbox_id: str) -> bool:
        sandbox = self._get(sandbox_id)
        if sandbox.paused or sandbox.busy():
            return False
        return await self._backend.recycle(sandbox_id)

    async def fs_clock(self, sandbox_id: str) -> float:
        self._get(sandbox_id)
        return await self._backend.fs_clock(sandbox_id)

    async def changed_paths(self, sandbox_id: str, since: float) -> list[str]:
        self._get(sandbox_id)
        changed = await self._backend.changed_paths(sandbox_id, since)
        self.metrics.found_step_files(changed.how)
        return changed.paths

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        self._get(sandbox_id)
        await self._backend.pack_diff(sandbox_id, dest)

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> bool:
        await self._active(sandbox_id)
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is not None and sandbox.watcher is not None:
            sandbox.watcher.cancel()  # its end is ours to report: "shutdown", not "exited"
        return await self._backend.shutdown(sandbox_id, timeout_s)

    async def _checkpoints(self, sandbox_id: str, *, resume: bool) -> Checkpointing:
        sandbox = await self._active(sandbox_id) if resume else self._get(sandbox_id)
        return checkpoints_of(self._backend, sandbox.spec)

    async def checkpoint(self, sandbox_id: str, dest: Path) -> Path:
        """Memory, processes and disk into ``dest``; returns where they are (``dest``)."""
        await (await self._checkpoints(sandbox_id, resume=True)).checkpoint(sandbox_id, dest)
        return dest

    async def discard_checkpoint(self, path: Path) -> None:
        """A checkpoint of this edge is where ``checkpoint`` was asked to write it: the caller owns that place."""
        raise InvalidRequest(f"{path} is not a checkpoint this edge wrote somewhere of its own")

    async def save_checkpoint(self, sandbox_id: str) -> dict[str, object]:
        return await (await self._checkpoints(sandbox_id, resume=True)).save_checkpoint(sandbox_id)

    async def list_checkpoints(self, sandbox_id: str) -> list[dict[str, object]]:
        return (await self._checkpoints(sandbox_id, resume=False)).list_checkpoints(sandbox_id)

    async def checkpoint_dir(self, sandbox_id: str, checkpoint_id: str) -> Path:
        return (await self._checkpoints(sandbox_id, resume=False)).checkpoint_dir(sandbox_id, checkpoint_id)

    async def rewind(self, sandbox_id: str, checkpoint_id: str) -> None:
        await (await self._checkpoints(sandbox_id, resume=True)).rewind(sandbox_id, checkpoint_id)

    # -- files --------------------------------------------------------------

    async def _in_tree(self, sandbox_id: str, operation: Callable[[FileTree], R]) -> R:
        await self._active(sandbox_id)
        tree = self._backend.files(sandbox_id)

        def call() -> R:
            with tree:
                return operation(tree)

        return await asyncio.to_thread(call)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._in_tree(sandbox_id, lambda t: t.read(path, max_bytes=self._capacity.max_file_bytes))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> FileInfo:
        """Files (and the directories made for them) belong to the sandbox's user, as if it wrote them."""
        sandbox = await self._active(sandbox_id)

        def write(tree: FileTree) -> FileInfo:
            if sandbox.owner is None:
                sandbox.owner = _lookup_owner(tree, sandbox.spec.user)
            uid, gid = sandbox.owner
            return tree.write(path, data, mode=mode, uid=uid, gid=gid)

        return await self._in_tree(sandbox_id, write)

    async def stat(self, sandbox_id: str, path: str) -> FileInfo:
        return await self._in_tree(sandbox_id, lambda t: t.stat(path))

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileInfo]:
        return await self._in_tree(sandbox_id, lambda t: t.list(path))

    async def mkdir(self, sandbox_id: str, path: str, parents: bool, mode: int) -> FileInfo:
        return await self._in_tree(sandbox_id, lambda t: t.mkdir(path, parents=parents, mode=mode))

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._in_tree(sandbox_id, lambda t: t.remove(path, recursive=recursive))

    async def rename(self, sandbox_id: str, source: str, dest: str) -> FileInfo:
        return await self._in_tree(sandbox_id, lambda t: t.rename(source, dest))

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, keep_owners: bool = False) -> int:
        limit = self._capacity.max_file_bytes
        return await self._in_tree(
            sandbox_id, lambda t: t.extract_tar(path, io.BytesIO(data), max_bytes=limit, keep_owners=keep_owners)
        )

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        def pack(tree: FileTree) -> bytes:
            buffer = io.BytesIO()
            tree.write_tar(path, buffer)
            return buffer.getvalue()

        return await self._in_tree(sandbox_id, pack)


def pressure_refusal(cap: NodeCapacity, host: HostReadings) -> str | None:
    """Why the node should take no new sandbox now (real memory pressure), or None."""
    if host.memory_available_mb < cap.memory_reserve_mb:
        return f"memory is short: {host.memory_available_mb} MiB available, {cap.memory_reserve_mb} MiB kept in reserve"
    if host.memory_full_avg10 > cap.memory_full_pressure_pct:
        return (
            f"the node is thrashing: memory pressure (PSI full avg10) {host.memory_full_avg10:.0f}% "
            f"> {cap.memory_full_pressure_pct:g}%"
        )
    return None


def memory_is_short(cap: NodeCapacity, host: HostReadings) -> bool:
    """Short enough to reclaim from idle sandboxes (before admission refuses): under twice the reserve
    available, or memory stalls (PSI "some") above twice the thrashing limit."""
    return host.memory_available_mb < 2 * cap.memory_reserve_mb or (
        host.memory_some_avg10 > 2 * cap.memory_full_pressure_pct
    )


def node_capacity(
    cpu_overcommit: float,
    memory_overcommit: float,
    max_file_bytes: int,
    *,
    labels: dict[str, str] | None = None,
    memory_reserve_mb: int = NodeCapacity.memory_reserve_mb,
    memory_full_pressure_pct: float = NodeCapacity.memory_full_pressure_pct,
    pressure_pause_idle_s: float = NodeCapacity.pressure_pause_idle_s,
    disk_floor_mb: int = NodeCapacity.disk_floor_mb,
    data_dir: Path | None = None,
    output_buffer_bytes: int = NodeCapacity.output_buffer_bytes,
) -> NodeCapacity:
    """This machine's cores and RAM, with the configured overcommit (and pressure limits and labels, see
    NodeCapacity)."""
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    cpu = float(os.cpu_count() or 1)
    return NodeCapacity(
        cpu, memory_mb, cpu_overcommit, memory_overcommit, max_file_bytes, memory_reserve_mb=memory_reserve_mb,
        memory_full_pressure_pct=memory_full_pressure_pct, pressure_pause_idle_s=pressure_pause_idle_s,
        labels=dict(labels or {}), disk_floor_mb=disk_floor_mb, data_dir=data_dir,
        output_buffer_bytes=output_buffer_bytes,
    )  # fmt: skip
