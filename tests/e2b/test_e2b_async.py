"""The unmodified e2b SDK (async): the same facade through AsyncSandbox, including streamed watches."""

from __future__ import annotations

import asyncio

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    PtySize,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)


@pytest.fixture
async def asbx(e2b_env: dict[str, str]):  # type: ignore[no-untyped-def]
    sandbox = await AsyncSandbox.create("base", metadata={"suite": "async"}, timeout=300)
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def test_lifecycle(asbx: AsyncSandbox) -> None:
    info = await asbx.get_info()
    assert info.metadata == {"suite": "async"} and info.state == SandboxState.RUNNING
    await asbx.set_timeout(900)
    listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"})).next_items()
    assert asbx.sandbox_id in [s.sandbox_id for s in listed]
    assert await asbx.pause() is True
    assert await asbx.get_metrics() == []  # sampling a paused sandbox would resume it
    resumed = await AsyncSandbox.connect(asbx.sandbox_id)
    assert (await resumed.get_info()).state == SandboxState.RUNNING
    (sample,) = await asbx.get_metrics()
    assert sample.mem_used > 0


async def test_commands(asbx: AsyncSandbox) -> None:
    seen: list[str] = []
    result = await asbx.commands.run("echo a; sleep 0.2; echo b", on_stdout=seen.append)
    assert result.stdout == "a\nb\n" and seen == ["a\n", "b\n"]
    handle = await asbx.commands.run("cat", background=True, stdin=True)
    await asbx.commands.send_stdin(handle.pid, "piped\n")
    await asbx.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "piped\n"
    with pytest.raises(CommandExitException):
        await asbx.commands.run("exit 7")
    with pytest.raises(TimeoutException):
        await asbx.commands.run("sleep 30", timeout=1)
    sleeper = await asbx.commands.run("sleep 600", background=True)
    assert sleeper.pid in [p.pid for p in await asbx.commands.list()]
    assert await asbx.commands.kill(sleeper.pid) is True


async def test_files_and_streamed_watch(asbx: AsyncSandbox) -> None:
    await asbx.files.make_dir("/home/user/w")
    events = []
    watch = await asbx.files.watch_dir("/home/user/w", on_event=events.append)
    try:
        await asbx.files.write("/home/user/w/a.txt", "1")
        for _ in range(50):
            if events:
                break
            await asyncio.sleep(0.1)
    finally:
        await watch.stop()
    assert ("a.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in events]
    assert await asbx.files.read("/home/user/w/a.txt") == "1"
    await asbx.files.rename("/home/user/w/a.txt", "/home/user/w/b.txt")
    assert [e.name for e in await asbx.files.list("/home/user/w")] == ["b.txt"]
    await asbx.files.remove("/home/user/w")
    assert not await asbx.files.exists("/home/user/w")


async def test_pty_session_with_resize(asbx: AsyncSandbox) -> None:
    output = bytearray()

    async def wait_for(text: bytes) -> None:
        for _ in range(100):
            if text in output:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{text!r} never came; the terminal showed {bytes(output)!r}")

    terminal = await asbx.pty.create(PtySize(rows=30, cols=100), on_data=output.extend)
    await asbx.pty.send_stdin(terminal.pid, b"stty size; tty; echo $TERM\n")
    await wait_for(b"xterm-256color")
    assert b"30 100" in output and b"/dev/pts/" in output
    await asbx.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    await asbx.pty.send_stdin(terminal.pid, b"stty size; exit 3\n")
    with pytest.raises(CommandExitException) as ended:
        await terminal.wait()
    assert ended.value.exit_code == 3 and b"40 120" in output
