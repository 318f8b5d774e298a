"""The edge's side of the agent protocol, against the real compiled agent."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest

from corral.backends.common.agent_protocol import (
    AgentConnection,
    AgentExit,
    AgentOutput,
    AgentStarted,
    ExecOrder,
    IpcCounts,
)
from corral.backends.common.host import build_native_helpers


def test_exec_order_rejects_nul() -> None:
    order = ExecOrder(["echo", "a\0b"], {}, "/", "", 1000, 100, False)
    with pytest.raises(ValueError):
        order.encode()


@pytest.fixture
async def agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The real agent binary as a plain child process (no container needed)."""
    helpers = build_native_helpers(tmp_path)
    edge_end, agent_end = socket.socketpair()
    process = subprocess.Popen([str(helpers.agent), "--fd", str(agent_end.fileno())], pass_fds=(agent_end.fileno(),))
    agent_end.close()
    connection = AgentConnection(edge_end)
    await connection.start(hello_timeout_s=5)
    try:
        yield connection
    finally:
        connection.close()
        await asyncio.to_thread(process.wait, 5)  # an attached agent ends with its edge


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
