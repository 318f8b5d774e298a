"""The edge's side of the agent protocol, against the real compiled agent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from corral.api.errors import Conflict, ServerUnavailable
from corral.backends.common.agent_protocol import (
    _HEADER,
    F_IPC_ALONE,
    T_EXEC,
    T_EXIT,
    T_FIND,
    T_FOUND,
    T_HELLO,
    T_IDENTIFY,
    T_KILL_ALL,
    T_PING,
    T_PONG,
    T_STARTED,
    T_STDERR,
    T_STDOUT,
    AgentConnection,
    AgentExit,
    AgentOutput,
    AgentStarted,
    ExecOrder,
    IpcCounts,
    TreeWalk,
    _FrameReader,
)
from corral.backends.common.host import build_native_helpers
from corral.backends.vm.backend import ExitWalk, walk_still_current


def test_exec_order_rejects_nul() -> None:
    order = ExecOrder(["echo", "a\0b"], {}, "/", "", 1000, 100, False)
    with pytest.raises(ValueError):
        order.encode()


@contextlib.asynccontextmanager
async def real_agent(tmp_path: Path, *wrapper: str) -> AsyncIterator[AgentConnection]:
    """The real agent binary as a plain child process (no container needed), started through ``wrapper``."""
    helpers = build_native_helpers(tmp_path)
    edge_end, agent_end = socket.socketpair()
    argv = [*wrapper, str(helpers.agent), "--fd", str(agent_end.fileno())]
    process = subprocess.Popen(argv, pass_fds=(agent_end.fileno(),))
    agent_end.close()
    connection = AgentConnection(edge_end)
    await connection.start(hello_timeout_s=5)
    try:
        yield connection
    finally:
        connection.close()
        if wrapper[:1] == ("unshare",) and "--pid" in wrapper:
            process.kill()  # an init stays after its edge goes; unshare's --kill-child takes it along
        await asyncio.to_thread(process.wait, 5)  # an attached agent ends with its edge


@pytest.fixture
async def agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with real_agent(tmp_path) as connection:
        yield connection


def order(argv: list[str], *, timeout_ms: int = 5000, cap: int = 1 << 20, stdin: bool = False) -> ExecOrder:
    return ExecOrder(argv, {"PATH": os.environ["PATH"]}, "/", "", timeout_ms, cap, stdin)


async def collect(agent: AgentConnection, o: ExecOrder, stdin: bytes | None = None) -> tuple[bytes, bytes, AgentExit]:
    out, err, end = b"", b"", None
    async for event in agent.run(agent.new_job_id(), o, stdin):
        if isinstance(event, AgentOutput):
            out, err = (out + event.data, err) if event.stream == "stdout" else (out, err + event.data)
        elif isinstance(event, AgentExit):
            end = event
        else:
            assert isinstance(event, AgentStarted) and event.pid > 0
    assert end is not None
    return out, err, end


async def test_output_and_exit_code(agent: AgentConnection) -> None:
    out, err, end = await collect(agent, order(["/bin/sh", "-c", "echo o; echo e >&2; exit 7"]))
    assert (out, err, end.exit_code) == (b"o\n", b"e\n", 7)


async def test_a_quiet_start_sends_the_output_and_exit_and_no_started_frame(agent: AgentConnection) -> None:
    """A waited exec reads only the output and the exit: the agent leaves out STARTED (one frame less each)."""
    loud = [type(event) async for event in agent.run(agent.new_job_id(), order(["/bin/echo", "hi"]))]
    quiet_order = replace(order(["/bin/sh", "-c", "echo hi; exit 3"]), announce_start=False)
    quiet = [event async for event in agent.run(agent.new_job_id(), quiet_order)]
    assert loud == [AgentStarted, AgentOutput, AgentExit]
    assert [type(event) for event in quiet] == [AgentOutput, AgentExit]
    assert quiet[0] == AgentOutput("stdout", b"hi\n") and isinstance(quiet[1], AgentExit) and quiet[1].exit_code == 3


async def test_stdin_and_cap(agent: AgentConnection) -> None:
    out, _, end = await collect(agent, order(["cat"], cap=10, stdin=True), b"0123456789abcdef")
    assert out == b"0123456789" and end.stdout_truncated


async def test_timeout(agent: AgentConnection) -> None:
    _, _, end = await collect(agent, order(["sleep", "10"], timeout_ms=200))
    assert end.timed_out and end.exit_code == -9


async def test_parallel_jobs(agent: AgentConnection) -> None:
    results = await asyncio.gather(
        *(collect(agent, order(["/bin/sh", "-c", f"sleep 0.2; echo {i}"])) for i in range(10))
    )
    assert [r[0] for r in results] == [f"{i}\n".encode() for i in range(10)]


async def test_ipc_counts_see_the_agents_own_ipc_namespace(tmp_path: Path) -> None:
    """The agent reports the SysV objects of its IPC namespace (a fresh one here), which the host cannot see."""
    helpers = build_native_helpers(tmp_path)
    edge_end, agent_end = socket.socketpair()
    argv = ["unshare", "--ipc", str(helpers.agent), "--fd", str(agent_end.fileno())]
    process = subprocess.Popen(argv, pass_fds=(agent_end.fileno(),))
    agent_end.close()
    agent = AgentConnection(edge_end)
    try:
        await agent.start(hello_timeout_s=5)
        assert await agent.ipc_counts() == IpcCounts(0, 0, 0)
        _, err, end = await collect(agent, order(["/bin/sh", "-c", "ipcmk -M 4096 && ipcmk -Q && ipcmk -S 2"]))
        assert end.exit_code == 0, err
        assert await agent.ipc_counts() == IpcCounts(1, 1, 1)
        host = subprocess.run(["ipcs", "-m"], capture_output=True, text=True, check=True).stdout
        out, _, _ = await collect(agent, order(["ipcs", "-m"]))
        assert out.decode() != host  # the same command in the host's namespace sees other objects
    finally:
        agent.close()
        await asyncio.to_thread(process.wait, 5)


def counted(argv: list[str]) -> ExecOrder:
    return replace(order(argv), ipc_after=True)


async def test_an_exit_carries_the_ipc_counts_taken_with_the_agent_alone_until_the_next_exec(tmp_path: Path) -> None:
    """EXEC flag 64: the agent as a sandbox's init (pid 1 of its namespaces) counts the IPC objects at a command's
    exit if no other process is left, and the edge takes them for the IPC query's answer until it sends another
    EXEC (what a pooled call's recycle asks, without its round trip). A process left running means no counts."""
    async with real_agent(tmp_path, "unshare", "--ipc", "--pid", "--fork", "--kill-child") as agent:
        _, _, end = await collect(agent, counted(["true"]))
        assert end.ipc_alone == IpcCounts(0, 0, 0) == agent.ipc_when_alone()
        _, err, end = await collect(
            agent, counted(["/bin/sh", "-c", "ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null"])
        )
        assert end.exit_code == 0, err
        assert end.ipc_alone == IpcCounts(1, 1, 0) == agent.ipc_when_alone() == await agent.ipc_counts()
        job_id = agent.new_job_id()
        running = agent.run(job_id, counted(["sleep", "30"]))
        assert isinstance(await anext(running), AgentStarted)
        assert agent.ipc_when_alone() is None  # a command runs: it may make more
        agent.signal(job_id, 9)
        ended = [event async for event in running]
        assert isinstance(ended[-1], AgentExit) and ended[-1].ipc_alone == IpcCounts(1, 1, 0)
        _, _, end = await collect(agent, counted(["/bin/sh", "-c", "sleep 30 & exit 0"]))
        assert end.exit_code == 0 and end.ipc_alone is None and agent.ipc_when_alone() is None  # sleep is left
        await agent.kill_all()
        _, _, end = await collect(agent, order(["true"]))
        assert end.ipc_alone is None and agent.ipc_when_alone() is None  # not asked for


async def test_an_agent_that_is_not_its_sandboxs_init_sends_no_ipc_counts(agent: AgentConnection) -> None:
    """Another process's orphans would not come to it: having no child does not mean being alone."""
    _, _, end = await collect(agent, counted(["true"]))
    assert end.exit_code == 0 and end.ipc_alone is None and agent.ipc_when_alone() is None


async def test_ipc_counts_on_an_exit_that_comes_after_a_later_exec_was_sent_are_not_kept() -> None:
    """The first command's exit says the agent was alone, but the edge had already sent a second command, which
    may have made IPC objects since: only the last command's exit counts."""
    execs: list[int] = []

    def exit_frame(job_id: int, shm_segments: int) -> bytes:
        payload = struct.pack("<iB", 0, F_IPC_ALONE) + struct.pack("<III", shm_segments, 0, 0)
        return _HEADER.pack(5 + len(payload), T_EXIT, job_id) + payload

    def answer(kind: int, job_id: int) -> bytes:
        if kind == T_EXEC:
            execs.append(job_id)
            return exit_frame(execs[0], 0) if len(execs) == 2 else b""  # the first ends once the second is sent
        if kind == T_KILL_ALL:  # then the second
            return exit_frame(execs[1], 2) + _HEADER.pack(5, T_PONG, job_id)
        return b""

    async with older_agent(answer) as agent:
        first = asyncio.ensure_future(collect(agent, counted(["true"])))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(collect(agent, counted(["true"])))
        _, _, first_end = await asyncio.wait_for(first, 5)
        assert first_end.ipc_alone == IpcCounts(0, 0, 0) and agent.ipc_when_alone() is None
        await asyncio.wait_for(agent.kill_all(), 5)
        _, _, second_end = await asyncio.wait_for(second, 5)
        assert second_end.ipc_alone == IpcCounts(2, 0, 0) == agent.ipc_when_alone()


async def test_find_lists_what_is_under_each_path_without_following_symlinks(
    agent: AgentConnection, tmp_path: Path
) -> None:
    """The audit's walk of a guest's writable layer, done by the agent: every non-directory under each path that
    exists (a whiteout, a symlink, a file in a subdirectory), named relative to the root, nothing outside them."""
    upper = tmp_path / "upper"
    (upper / "usr/bin/sub").mkdir(parents=True)
    (upper / "usr/bin/tool").write_text("x")
    (upper / "usr/bin/sub/deep").write_text("y")
    (upper / "usr/bin/to-etc").symlink_to("/etc")  # listed, not followed
    os.mknod(upper / "usr/bin/removed", 0o600 | stat.S_IFCHR, 0)  # overlayfs's whiteout of a deleted file
    (upper / "etc").mkdir()
    (upper / "etc/ld.so.preload").write_text("evil.so")
    (upper / "home").mkdir()
    (upper / "home/untouched").write_text("z")
    found = await agent.find(str(upper), ["usr/bin", "etc/ld.so.preload", "lib", "bin"], 1 << 20)
    assert found is not None
    names, cut = found
    assert sorted(names) == ["etc/ld.so.preload", "usr/bin/removed", "usr/bin/sub/deep", "usr/bin/to-etc",
                             "usr/bin/tool"]  # fmt: skip
    assert not cut
    assert await agent.find(str(tmp_path / "no-such-root"), ["usr/bin"], 1 << 20) == ([], False)


async def test_find_stops_at_its_cap_and_says_so(agent: AgentConnection, tmp_path: Path) -> None:
    for index in range(100):
        (tmp_path / f"file-{index:03}").write_text("")
    found = await agent.find(str(tmp_path.parent), [tmp_path.name], 200)
    assert found is not None
    names, cut = found
    assert cut and 0 < len(names) < 100 and sum(len(name) + 1 for name in names) <= 200
    assert all(name.startswith(f"{tmp_path.name}/file-") for name in names)


@contextlib.asynccontextmanager
async def older_agent(answer: Callable[[int, int], bytes]) -> AsyncIterator[AgentConnection]:
    """A connection to a peer that speaks only what an agent of an older build does: its hello, then for each
    frame it reads (type, job id) what ``answer`` gives back (nothing for a type it does not know)."""
    edge_end, peer_end = socket.socketpair()

    def serve() -> None:
        peer_end.sendall(_HEADER.pack(13, T_HELLO, 0) + struct.pack("<II", 2, os.getpid()))
        buffer = b""
        while chunk := peer_end.recv(65536):
            buffer += chunk
            while len(buffer) >= 4 and len(buffer) >= 4 + struct.unpack_from("<I", buffer)[0]:
                total, kind, job_id = _HEADER.unpack_from(buffer)
                buffer = buffer[4 + total :]
                peer_end.sendall(answer(kind, job_id))

    peer = asyncio.get_running_loop().run_in_executor(None, serve)
    agent = AgentConnection(edge_end)
    try:
        await agent.start(hello_timeout_s=5)
        yield agent
    finally:
        agent.close()
        peer_end.shutdown(socket.SHUT_RDWR)
        await peer
        peer_end.close()


async def test_find_learns_once_that_an_older_agent_cannot() -> None:
    """An agent built before FIND ignores it (as it does any type it does not know) and answers the ping sent
    behind it: the edge is told to walk another way, and asks no more on that connection."""
    seen: list[int] = []

    def answer(kind: int, job_id: int) -> bytes:
        seen.append(kind)
        return _HEADER.pack(5, T_PONG, job_id) if kind == T_PING else b""

    async with older_agent(answer) as agent:
        assert await asyncio.wait_for(agent.find("/scratch/upper", ["usr/bin"], 1 << 20), 5) is None
        assert await asyncio.wait_for(agent.find("/scratch/upper", ["usr/bin"], 1 << 20), 5) is None
    assert seen == [T_FIND, T_PING]  # the second call sent nothing


async def test_a_walk_after_a_command_sees_what_the_command_wrote(agent: AgentConnection, tmp_path: Path) -> None:
    """EXEC flag 16: the agent walks once the command has exited (not when it starts), and the names ride on its
    exit; the command's own output is untouched. With a terminal the walk's request follows the terminal's size."""
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    walk = TreeWalk(str(upper), ("usr/bin", "etc/ld.so.preload"), 1 << 20)
    script = f"mkdir -p {upper}/usr/bin/sub && : > {upper}/usr/bin/sub/new && echo done"
    out, _, end = await collect(agent, ExecOrder(["sh", "-c", script], {"PATH": os.environ["PATH"]}, "/", "",
                                                 5000, 1 << 20, False, walk_after=walk))  # fmt: skip
    assert out == b"done\n" and end.exit_code == 0
    assert end.walked == (["usr/bin/sub/new"], False)
    (upper / "etc/ld.so.preload").write_text("evil.so")
    terminal = ExecOrder(["true"], {"PATH": os.environ["PATH"]}, "/", "", 5000, 1 << 20, False, terminal=(24, 80),
                         walk_after=walk)  # fmt: skip
    _, _, end = await collect(agent, terminal)
    assert end.walked is not None and sorted(end.walked[0]) == ["etc/ld.so.preload", "usr/bin/sub/new"]
    _, _, end = await collect(agent, order(["true"]))
    assert end.walked is None  # not asked for


async def test_a_walk_after_a_command_stops_at_its_cap(agent: AgentConnection, tmp_path: Path) -> None:
    for index in range(100):
        (tmp_path / f"file-{index:03}").write_text("")
    walk = TreeWalk(str(tmp_path.parent), (tmp_path.name,), 200)
    _, _, end = await collect(agent, ExecOrder(["true"], {"PATH": os.environ["PATH"]}, "/", "", 5000, 1 << 20,
                                               False, walk_after=walk))  # fmt: skip
    assert end.walked is not None
    names, cut = end.walked
    assert cut and 0 < len(names) < 100 and sum(len(name) + 1 for name in names) <= 200


async def test_an_older_agent_runs_the_command_and_sends_no_walk() -> None:
    """An agent built before EXEC flag 16 ignores it and the bytes after the strings: the command runs, its exit
    says nothing was walked (the edge then asks FIND)."""

    def answer(kind: int, job_id: int) -> bytes:
        if kind != T_EXEC:
            return b""
        started = _HEADER.pack(9, T_STARTED, job_id) + struct.pack("<I", 4242)
        return started + _HEADER.pack(10, T_EXIT, job_id) + struct.pack("<iB", 0, 0)

    async with older_agent(answer) as agent:
        walk = TreeWalk("/scratch/upper", ("usr/bin",), 1 << 20)
        exec_order = ExecOrder(["true"], {}, "/", "", 5000, 100, False, walk_after=walk)
        _, _, end = await asyncio.wait_for(collect(agent, exec_order), 5)
        assert end.exit_code == 0 and end.walked is None


def test_a_walk_at_an_exit_answers_the_audit_only_until_another_command_starts() -> None:
    """The rule VmBackend.findings applies: the walk at command 7's exit is the audit's answer while 7 is still the
    last command sent to the agent and the audit asks the same walk; else the agent must walk again."""
    request = TreeWalk("/scratch/upper", ("etc/ld.so.preload", "usr/bin"), 1 << 20)
    walked = ExitWalk(7, request, ["usr/bin/x"], False)
    assert walk_still_current(walked, 7, request) == (["usr/bin/x"], False)
    assert walk_still_current(walked, 8, request) is None  # a command (or a file operation) started since
    assert walk_still_current(walked, 7, TreeWalk("/scratch/upper", ("usr/bin",), 1 << 20)) is None
    assert walk_still_current(None, 7, request) is None


async def test_identify_sets_the_hostname_without_a_process(tmp_path: Path) -> None:
    """IDENTIFY (a restored guest's own hostname and entropy) is done by the agent itself; in a UTS namespace of
    its own here, so the host keeps its name."""
    async with real_agent(tmp_path, "unshare", "--uts") as agent:
        assert await asyncio.wait_for(agent.identify("sb-restored-1", os.urandom(64)), 5)
        out, _, end = await collect(agent, order(["cat", "/proc/sys/kernel/hostname"]))
        assert out == b"sb-restored-1\n" and end.exit_code == 0
        assert await agent.identify("again", b"")  # no entropy: the hostname alone
        out, _, _ = await collect(agent, order(["cat", "/proc/sys/kernel/hostname"]))
        assert out == b"again\n"
        with pytest.raises(Conflict, match="sethostname"):
            await agent.identify("x" * 65, b"")  # longer than the kernel takes
    assert socket.gethostname() != "again"


async def test_identify_reseeds_the_kernels_generator_or_says_it_could_not(tmp_path: Path) -> None:
    """Entropy added to the kernel reaches /dev/urandom's output only at the generator's next reseed, seconds apart
    after a boot: restores of one template gave the same random bytes until then. IDENTIFY reseeds at once
    (RNDRESEEDCRNG), which needs CAP_SYS_ADMIN of the host's namespace: where it is missing (a user namespace
    here, never a guest's root) IDENTIFY fails naming it rather than leave the copy's generator in step."""
    async with real_agent(tmp_path, "unshare", "--user", "--map-root-user", "--uts") as agent:
        assert await agent.identify("no-entropy", b"")  # the hostname alone needs no reseed
        with pytest.raises(Conflict, match="RNDRESEEDCRNG"):
            await asyncio.wait_for(agent.identify("sb-restored-3", os.urandom(64)), 5)


async def test_identify_tells_when_an_older_agent_ignored_it() -> None:
    """A guest restored from a checkpoint an older build made runs an agent without IDENTIFY: it ignores it, the
    ping behind it says so, and the caller falls back to a shell."""
    seen: list[int] = []

    def answer(kind: int, job_id: int) -> bytes:
        seen.append(kind)
        return _HEADER.pack(5, T_PONG, job_id) if kind == T_PING else b""

    async with older_agent(answer) as agent:
        assert await asyncio.wait_for(agent.identify("sb-restored-2", b"x" * 16), 5) is False
    assert seen == [T_IDENTIFY, T_PING]


def test_frames_come_out_whole_however_the_stream_is_cut() -> None:
    """The reader hands on each frame once it is whole, in order, whether it arrived in one read, a byte at a
    time, or cut at any point (a large frame arrives over many reads)."""
    frames = [(T_STDOUT, 1, b"x" * 70_000), (T_EXIT, 1, struct.pack("<iB", 0, 0)), (T_PONG, 2, b""),
              (T_STDOUT, 3, bytes(range(256)) * 3)]  # fmt: skip
    stream = b"".join(_HEADER.pack(5 + len(payload), kind, job) + payload for kind, job, payload in frames)

    def read(pieces: list[bytes]) -> list[tuple[int, int, bytes]]:
        seen: list[tuple[int, int, bytes]] = []
        lost: list[Exception | None] = []
        reader = _FrameReader(lambda kind, job, payload: seen.append((kind, job, bytes(payload))), lost.append)
        for piece in pieces:
            reader.data_received(piece)
        assert lost == []
        return seen

    assert read([stream]) == frames
    assert read([stream[i : i + 1] for i in range(len(stream))]) == frames
    for cut in (1, 4, 8, 9, 10, 9 + 69_999, 9 + 70_000, 9 + 70_000 + 1, len(stream) - 1):
        assert read([stream[:cut], stream[cut:]]) == frames, cut
    assert read([stream[i : i + 4096] for i in range(0, len(stream), 4096)]) == frames


def test_stream_frames_that_arrive_together_are_handed_on_as_one() -> None:
    """Consecutive output (or walk) frames of one job and stream that one read holds become one frame with their
    payloads in order; a frame of another stream, job or kind ends the run, so the order of everything else is
    kept. Frames split across reads are joined only within each read."""
    frames = [(T_STDOUT, 1, b"a1"), (T_STDOUT, 1, b"a2"), (T_STDOUT, 1, b"a3"), (T_STDERR, 1, b"e1"),
              (T_STDOUT, 1, b"a4"), (T_STDOUT, 2, b"b1"), (T_STDOUT, 2, b"b2"), (T_FOUND, 2, b"n1\0"),
              (T_FOUND, 2, b"n2\0"), (T_EXIT, 2, struct.pack("<iB", 0, 0)), (T_EXIT, 2, struct.pack("<iB", 1, 0)),
              (T_STDOUT, 1, b"a5")]  # fmt: skip
    stream = b"".join(_HEADER.pack(5 + len(payload), kind, job) + payload for kind, job, payload in frames)
    seen: list[tuple[int, int, bytes]] = []
    reader = _FrameReader(lambda kind, job, payload: seen.append((kind, job, bytes(payload))), pytest.fail)
    reader.data_received(stream)
    assert seen == [(T_STDOUT, 1, b"a1a2a3"), (T_STDERR, 1, b"e1"), (T_STDOUT, 1, b"a4"), (T_STDOUT, 2, b"b1b2"),
                    (T_FOUND, 2, b"n1\0n2\0"), (T_EXIT, 2, struct.pack("<iB", 0, 0)),
                    (T_EXIT, 2, struct.pack("<iB", 1, 0)), (T_STDOUT, 1, b"a5")]  # fmt: skip
    seen.clear()
    cut = stream.index(b"a3") + 1  # the third output frame arrives in two reads
    reader.data_received(stream[:cut])
    reader.data_received(stream[cut:])
    assert seen[:2] == [(T_STDOUT, 1, b"a1a2"), (T_STDOUT, 1, b"a3")]
    assert b"".join(payload for _, _, payload in seen) == b"".join(payload for _, _, payload in frames)


async def test_large_output_and_stdin_pass_whole(agent: AgentConnection) -> None:
    """8 MiB of stdin (more than the socket holds: the writer waits for room) and 6 MiB of output (frames that
    span many reads) arrive whole."""
    data = os.urandom(8 << 20)
    out, _, end = await collect(agent, order(["/bin/sh", "-c", "wc -c; head -c 6291456 /dev/zero"], cap=16 << 20,
                                             stdin=True), data)  # fmt: skip
    assert end.exit_code == 0 and not end.stdout_truncated
    count, _, zeros = out.partition(b"\n")
    assert int(count) == len(data) and zeros == bytes(6 << 20)


async def test_a_bad_frame_fails_the_running_commands_and_closes_the_channel() -> None:
    """A frame length no agent sends (a corrupt stream) ends the channel: the waiting command gets an error,
    not a hang, and nothing more can be sent."""

    def answer(kind: int, job_id: int) -> bytes:
        return _HEADER.pack(3, T_STDOUT, job_id) if kind == T_EXEC else b""

    async with older_agent(answer) as agent:
        with pytest.raises(ServerUnavailable, match="lost the connection"):
            await asyncio.wait_for(collect(agent, order(["true"])), 5)
        assert agent.closed.is_set()
        with pytest.raises(ServerUnavailable, match="closed"):
            await agent.kill_all()


async def test_an_agent_that_hangs_up_fails_the_running_commands() -> None:
    """The agent's end closing mid-command (the sandbox died) fails the commands waiting on it."""
    edge_end, peer_end = socket.socketpair()
    peer_end.sendall(_HEADER.pack(13, T_HELLO, 0) + struct.pack("<II", 3, os.getpid()))
    agent = AgentConnection(edge_end)
    try:
        await agent.start(hello_timeout_s=5)
        running = asyncio.ensure_future(collect(agent, order(["sleep", "5"])))
        await asyncio.sleep(0.1)
        assert not running.done()
        peer_end.close()
        with pytest.raises(ServerUnavailable, match="lost the connection"):
            await asyncio.wait_for(running, 5)
        assert agent.closed.is_set()
    finally:
        agent.close()
        peer_end.close()


async def test_a_peer_gone_before_its_greeting_is_not_called_a_timeout() -> None:
    """A sandbox that stopped before its agent said hello (a VM killed while it booted) is said so at once."""
    edge_end, peer_end = socket.socketpair()
    agent = AgentConnection(edge_end)
    peer_end.close()
    begun = time.monotonic()
    with pytest.raises(ServerUnavailable, match="closed its connection before its hello"):
        await agent.start(hello_timeout_s=30)
    assert time.monotonic() - begun < 5 and agent.closed.is_set()


async def test_no_greeting_is_a_clear_error(tmp_path: Path) -> None:
    """A peer that never says hello (an agent that did not start) is told apart within the timeout."""
    edge_end, peer_end = socket.socketpair()
    agent = AgentConnection(edge_end)
    try:
        with pytest.raises(ServerUnavailable, match="did not start within"):
            await agent.start(hello_timeout_s=0.3)
        assert agent.closed.is_set()
    finally:
        peer_end.close()
