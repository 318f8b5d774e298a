"""`python -m corral.demo`: one agent coding episode in each of N sandboxes at once.

The demo starts its own `corral serve` on a free loopback port, with a temporary
data dir. Through the async SDK over real HTTP, it creates N debian-12 sandboxes
concurrently. In each one, an "agent" writes a buggy `calc.py` and a test for its
episode number, sees the test fail, reads the file back and fixes it, sees the
test pass, and commits with git. Every step is checked, and every figure printed
is measured in this run. Then one microVM sandbox (its own kernel) runs a
process and is forked with it (`--no-vm` skips it). Then it kills the sandboxes,
checks that none is still running, and stops the server. It must run as root, because the server creates
namespaces, cgroups and mounts. It exits with status 1 if any episode went wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.embedded import EmbeddedServer
from corral.sdk import AsyncClient, AsyncSandbox, CorralError, ExecResult

IMAGE = "debian-12"
VM_IMAGE = "busybox"
DEFAULT_SANDBOXES = 8
SANDBOX_CPU = 0.5
SANDBOX_MEMORY_MB = 256
SANDBOX_TTL_S = 600.0  # sandboxes leaked by a crashed demo still go away while the server runs
JOB_LABELS = {"job": "demo"}
CREATE_TIMEOUT_S = 60.0
EXEC_TIMEOUT_S = 60.0
WORKDIR = "/work"
# -B: the fix keeps calc.py's size and may keep its mtime second, the two things a cached .pyc is checked against.
TEST_CMD = "python3 -B test_calc.py"
COMMIT_CMD = "git init -q && git add -A && git -c user.email=agent@corral -c user.name=agent commit -qm fix"
BUGGY_CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = """from calc import add

actual = add({n}, 1)
assert actual == {n} + 1, f"add({n}, 1) returned {{actual}}, expected {{{n} + 1}}"
print("ok: add({n}, 1) ==", actual)
"""
EXEC_STEPS = ("test", "retest", "git commit")
T = TypeVar("T")


class EpisodeFailed(Exception):
    """The sandbox answered, but not the way the episode expected."""


@dataclass
class Episode:
    """One sandbox's episode and what it measured; steps not reached stay None or "-"."""

    number: int
    creating: asyncio.Future[AsyncSandbox] | None = None
    sandbox: AsyncSandbox | None = None
    create_ms: float | None = None
    first_test: str = "-"
    assertion: str | None = None
    fix_retest_ms: float | None = None
    commit: str = "-"
    steps_ms: float | None = None
    exec_round_trip_ms: dict[str, float] = field(default_factory=dict)
    failure: str | None = None


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


async def _timed(awaitable: Awaitable[T]) -> tuple[T, float]:
    started = time.perf_counter()
    return await awaitable, _ms_since(started)


def _expect(condition: bool, reason: str) -> None:
    if not condition:
        raise EpisodeFailed(reason)


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no output)"])[-1]


async def _create(client: AsyncClient, episode: Episode) -> None:
    labels = {**JOB_LABELS, "episode": str(episode.number)}
    episode.creating = asyncio.ensure_future(client.create(
        IMAGE, cpu=SANDBOX_CPU, memory_mb=SANDBOX_MEMORY_MB, ttl_s=SANDBOX_TTL_S, labels=labels))  # fmt: skip
    try:
        # Shielded so that after Ctrl-C the request still finishes; _kill_all waits for it and kills the sandbox.
        episode.sandbox, episode.create_ms = await _timed(asyncio.shield(episode.creating))
    except CorralError as exc:
        episode.failure = f"create: {exc}"


async def _play(episode: Episode, sandbox: AsyncSandbox) -> None:
    """The agent's steps, each one checked. Files go through the files API, and the tests and git through exec."""

    async def run(step: str, cmd: str) -> ExecResult:
        result, round_trip_ms = await _timed(sandbox.exec(cmd, cwd=WORKDIR, timeout_s=EXEC_TIMEOUT_S))
        episode.exec_round_trip_ms[step] = round_trip_ms
        return result

    n, started = episode.number, time.perf_counter()
    try:
        await sandbox.files.write(f"{WORKDIR}/calc.py", BUGGY_CALC)
        await sandbox.files.write(f"{WORKDIR}/test_calc.py", TEST_CALC.format(n=n))
        first = await run("test", TEST_CMD)
        episode.first_test = f"{'pass' if first.exit_code == 0 else 'fail'} {episode.exec_round_trip_ms['test']:.0f}"
        assertion = _last_line(first.stderr)
        _expect(first.exit_code != 0 and f"add({n}, 1) returned {n - 1}, expected {n + 1}" in assertion,
                f"the buggy test exited {first.exit_code}: {assertion}")  # fmt: skip
        episode.assertion = assertion

        fix_started = time.perf_counter()
        source = await sandbox.files.read_text(f"{WORKDIR}/calc.py")
        _expect("a - b" in source, f"calc.py came back without the bug: {source!r}")
        await sandbox.files.write(f"{WORKDIR}/calc.py", source.replace("a - b", "a + b"))
        second = await run("retest", TEST_CMD)
        _expect(second.exit_code == 0 and second.stdout.strip() == f"ok: add({n}, 1) == {n + 1}",
                f"the fixed test exited {second.exit_code}: {_last_line(second.stderr)}")  # fmt: skip
        episode.fix_retest_ms = _ms_since(fix_started)

        git = await run("git commit", f"{COMMIT_CMD} && git log --oneline")
        log = git.stdout.strip().splitlines()
        _expect(git.exit_code == 0 and len(log) == 1 and log[0].endswith(" fix"),
                f"git exited {git.exit_code}: {_last_line(git.stderr + git.stdout)}")  # fmt: skip
        episode.commit = log[0].split()[0]
        episode.steps_ms = _ms_since(started)
    except (CorralError, EpisodeFailed) as exc:
        episode.failure = str(exc)


async def _each(progress: Progress, description: str, jobs: list[Coroutine[Any, Any, None]]) -> float:
    """Run the jobs concurrently under a progress bar; return the wall time in seconds."""
    task, started = progress.add_task(description, total=len(jobs)), time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for job in jobs:
            group.create_task(job).add_done_callback(lambda _: progress.advance(task))
    return time.perf_counter() - started


async def _kill_all(client: AsyncClient, episodes: list[Episode], console: Console) -> bool:
    """Wait for creates still in flight, kill every demo sandbox concurrently, and check that none is left running."""
    creating = [e.creating for e in episodes if e.creating is not None]
    if creating:
        await asyncio.wait(creating, timeout=CREATE_TIMEOUT_S)
    created = [f.result() for f in creating if f.done() and not f.cancelled() and f.exception() is None]
    try:
        ids = {sandbox.id for sandbox in created} | {info.id for info in await client.list(labels=JOB_LABELS)}
        _, kill_ms = await _timed(asyncio.gather(*(client.kill(i) for i in ids), return_exceptions=True))
        remaining = await client.list(state=["creating", "running"], labels=JOB_LABELS)
    except CorralError as exc:
        console.print(f"[red]could not kill the demo's sandboxes:[/red] {exc}")
        return False
    console.print(f"killed {len(ids)} sandboxes concurrently in {kill_ms:.0f} ms; "
                  f"{len(remaining)} job=demo sandboxes still running", highlight=False)  # fmt: skip
    return not remaining


def _ms(samples: list[float | None]) -> str:
    """The median of the samples that exist, in whole ms, or "-" when none does."""
    present = [sample for sample in samples if sample is not None]
    return f"{statistics.median(present):.0f}" if present else "-"


def _report(console: Console, episodes: list[Episode], create_wall_s: float, wall_s: float) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  title=f"{len(episodes)} agent episodes on {IMAGE} (times in ms)")  # fmt: skip
    for header in ("sandbox", "ep", "create", "1st test", "fix+test", "commit", "total", "status"):
        numeric = header in ("ep", "create", "fix+test", "total")
        table.add_column(header, no_wrap=True, justify="right" if numeric else "left")
    for e in episodes:
        total = e.create_ms + e.steps_ms if e.create_ms is not None and e.steps_ms is not None else None
        status = "ok" if e.failure is None else "[red]FAILED[/red]"
        table.add_row(e.sandbox.id if e.sandbox else "-", str(e.number), _ms([e.create_ms]), e.first_test,
                      _ms([e.fix_retest_ms]), e.commit, _ms([total]), status)  # fmt: skip
    console.print(table)
    for e in episodes:
        if e.failure is not None:
            console.print(f"[red]episode {e.number} FAILED:[/red] {e.failure}", highlight=False)
    if caught := [e for e in episodes if e.assertion]:
        console.print(f"episode {caught[-1].number}'s first test run: {caught[-1].assertion}", highlight=False)
    creates: list[float | None] = [e.create_ms for e in episodes if e.create_ms is not None]
    per_step = ", ".join(f"{step} {_ms([e.exec_round_trip_ms.get(step) for e in episodes])}" for step in EXEC_STEPS)
    console.print(f"wall time               {wall_s:.2f} s ({create_wall_s:.2f} s creating, then the episodes)\n"
                  f"created                 {len(creates) / create_wall_s:.1f} sandboxes/s\n"
                  f"create-to-ready median  {_ms(creates)} ms\n"
                  f"exec round trip median  {per_step} (ms)\n"
                  "total = create + the episode's own steps (without the wait for other creates)",
                  highlight=False)  # fmt: skip


async def _vm_episode(client: AsyncClient, console: Console) -> bool:
    """The same SDK on a VM sandbox: its own kernel, and a fork that carries a running process."""
    try:
        with console.status("booting a microVM sandbox (its own kernel; a few seconds under TCG)"):
            vm, boot_ms = await _timed(client.create(VM_IMAGE, backend="microvm", labels=JOB_LABELS, ttl_s=300))
            kernel = (await vm.exec("uname -r")).stdout.strip()
            await vm.exec("sleep 600 >/dev/null 2>&1 & echo $! > /root/pid")
            kids, fork_ms = await _timed(vm.fork(1, labels=JOB_LABELS))
            alive = await kids[0].exec("kill -0 $(cat /root/pid) && echo alive")
            _, rtt_ms = await _timed(vm.exec("true"))
    except CorralError as exc:
        console.print(f"[red]microVM episode FAILED:[/red] {exc}", highlight=False)
        return False
    ok = alive.stdout == "alive\n"
    console.print(f"microVM: guest kernel {kernel} (host {os.uname().release}); booted to first exec in "
                  f"{boot_ms:.0f} ms, exec round trip {rtt_ms:.0f} ms; fork with its running process in "
                  f"{fork_ms:.0f} ms ({'the process came along' if ok else '[red]the process is missing[/red]'})\n"
                  f"  {vm.info.status_message}", highlight=False)  # fmt: skip
    return ok


async def _demo(url: str, api_key: str, count: int, console: Console, *, with_vm: bool = True) -> bool:
    episodes = [Episode(number) for number in range(count)]
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    async with AsyncClient(url, api_key) as client:
        try:
            with Progress(*columns, console=console, transient=True) as progress:
                creating = [_create(client, e) for e in episodes]
                create_wall_s = await _each(progress, f"creating {count} sandboxes", creating)
                playing = [_play(e, e.sandbox) for e in episodes if e.sandbox is not None]
                episodes_wall_s = await _each(progress, "running the agent episodes", playing)
            _report(console, episodes, create_wall_s, create_wall_s + episodes_wall_s)
            vm_ok = await _vm_episode(client, console) if with_vm else True
        finally:
            all_killed = await _kill_all(client, episodes, console)
    return all_killed and vm_ok and all(e.failure is None for e in episodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral.demo", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sandboxes", type=int, default=DEFAULT_SANDBOXES, metavar="N",
                        help=f"sandboxes to create at once (default {DEFAULT_SANDBOXES})")  # fmt: skip
    parser.add_argument("--no-vm", action="store_true", help="skip the microVM episode")
    args = parser.parse_args(argv)
    if args.sandboxes < 1:
        parser.error("--sandboxes must be at least 1")
    if os.geteuid() != 0:
        parser.exit(1, "The demo must run as root, because its server creates namespaces, cgroups and mounts. "
                       "Try: sudo make demo\n")  # fmt: skip
    console = Console()
    data_dir = Path(tempfile.mkdtemp(prefix="corral-demo-", dir="/var/tmp"))
    try:
        with EmbeddedServer(data_dir) as server:
            console.print(f"corral server at {server.url}, data in {data_dir}", style="dim")
            return (
                0
                if asyncio.run(_demo(server.url, server.api_key, args.sandboxes, console, with_vm=not args.no_vm))
                else 1
            )
    except KeyboardInterrupt:
        console.print("[yellow]Interrupted.[/yellow]")
        return 130
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
