"""The fncall backend: short isolated calls served from pools of pre-warmed sandboxes.

A pool per (layers, memory, cpu, network) keeps sandboxes started ahead of
demand. A call takes one (a pool hit) or starts one (a miss), runs, and
gives it back: the edge kills every process the call left and checks that
nothing else of it is left either (no file in the writable layer, tmpfs or
IPC object differs from right after start). Only then does the sandbox serve
the next call; otherwise it is destroyed and replaced. So every call gets the
isolation of a fresh sandbox, and calls that only compute reuse warm ones.

Pools grow with the calls in flight and shrink when idle, within a node-wide
budget of warm sandboxes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from corral.api.errors import CorralError, InvalidRequest, NotFound, SandboxGone, error_from_response
from corral.api.models import (
    CreateSandboxRequest,
    ExecRequest,
    ExecResult,
    FnCallRequest,
    FnCallResult,
    PoolStats,
    RunCodeRequest,
    RunCodeResult,
    RunCodeTestResult,
)
from corral.gateway.service import SandboxService

__all__ = ["FnCallService"]

log = logging.getLogger(__name__)
T = TypeVar("T")
POOL_LABEL = "corral.fncall"  # SandboxService.list hides these unless asked
_RESULT_MARKER = "\x1ecorral-result:"
# Runs the caller's Python in-process: source and args arrive on stdin, so the call writes no file.
_PYTHON_HARNESS = (
    "import json,sys\n"
    "req=json.load(sys.stdin)\n"
    "ns={'__name__':'__fncall__'}\n"
    "try:\n"
    " exec(compile(req['code'],'<fncall>','exec'),ns)\n"
    " out={'result':ns['main'](*req['args']) if 'main' in ns else ns.get('result')}\n"
    "except BaseException as e:\n"
    " out={'error':type(e).__name__+': '+str(e)}\n"
    f"sys.stdout.write({_RESULT_MARKER!r}+json.dumps(out,default=repr))\n"
)
_IDLE_SHRINK_S = 30.0
_HOUSEKEEPING_INTERVAL_S = 5.0
_BATCH_CONCURRENCY = 16


@dataclass
class _Pool:
    template: CreateSandboxRequest
    idle: collections.deque[str] = field(default_factory=collections.deque)
    # Calls that found no warm sandbox wait here for the next one (returned or started), in order.
    waiters: collections.deque[asyncio.Future[tuple[str, bool] | None]] = field(default_factory=collections.deque)
    target: int = 1  # the pool's size: warm + starting + in use
    in_use: int = 0
    recycling: int = 0  # given back, being checked: counted so that a refill does not replace them
    starting: int = 0
    hits: int = 0
    misses: int = 0
    recycled: int = 0
    replaced: int = 0
    last_call: float = field(default_factory=time.monotonic)


class FnCallService:
    def __init__(self, sandboxes: SandboxService, *, warm_budget: int, min_warm: int, max_per_pool: int) -> None:
        self._sandboxes = sandboxes
        self._warm_budget = warm_budget
        self._min_warm = min_warm
        self._max_per_pool = max_per_pool
        self._pools: dict[tuple[Any, ...], _Pool] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Sandboxes of an earlier run's pools are not ours any more: remove them; then keep house."""
        stale = [info.id for info in await self._sandboxes.list(states=None, labels={POOL_LABEL: "1"})]
        await asyncio.gather(*(self._sandboxes.kill(sandbox_id) for sandbox_id in stale), return_exceptions=True)
        self._spawn(self._keep_house())

    async def _keep_house(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING_INTERVAL_S)
            self.housekeeping()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pool in self._pools.values():
            while pool.idle:
                with contextlib.suppress(CorralError):
                    await self._sandboxes.kill(pool.idle.popleft())

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- pools ----------------------------------------------------------

    def _pool_for(self, call: FnCallRequest) -> _Pool:
        """Calls with the same image or environment, limits and network share a pool."""
        image = call.image or ("debian-12" if call.code is not None else "busybox")
        key = (image, call.environment.model_dump_json() if call.environment else None, call.memory_mb, call.cpu,
               call.network.model_dump_json() if call.network else None)  # fmt: skip
        pool = self._pools.get(key)
        if pool is None:
            self._sandboxes.stack([image] if call.environment is None else [call.environment.base])  # fail early
            template = CreateSandboxRequest(
                image=image, environment=call.environment, memory_mb=call.memory_mb, cpu=call.cpu,
                network=call.network, labels={POOL_LABEL: "1"}, ttl_s=None,
            )  # fmt: skip
            pool = self._pools[key] = _Pool(template=template, target=self._min_warm)
        return pool

    def _warm_total(self) -> int:
        return sum(len(pool.idle) + pool.starting for pool in self._pools.values())

    def _refill(self, pool: _Pool) -> None:
        """Start sandboxes until the pool (warm, starting, in use, being recycled) has its target size, within the
        node budget."""
        while (
            len(pool.idle) + pool.starting + pool.in_use + pool.recycling < pool.target
            and self._warm_total() < self._warm_budget
        ):
            pool.starting += 1
            self._spawn(self._start_one(pool))

    async def _start_one(self, pool: _Pool) -> None:
        sandbox_id = None
        try:
            sandbox_id = (await self._sandboxes.create(pool.template)).id
        except CorralError as exc:
            log.warning("fncall pool could not start a sandbox: %s", exc.message)
        finally:
            pool.starting -= 1
        if sandbox_id is None:
            self._release_stranded(pool)
        else:
            self._offer(pool, sandbox_id, warm=False)

    def _offer(self, pool: _Pool, sandbox_id: str, *, warm: bool) -> None:
        """A ready sandbox goes to the longest-waiting call, else to the warm pool."""
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():  # a waiting request that went away left a cancelled future
                waiter.set_result((sandbox_id, warm))
                return
        pool.idle.append(sandbox_id)

    @staticmethod
    def _one_on_its_way(pool: _Pool, waiting: int) -> bool:
        """Whether a sandbox will become free for the calls waiting: one is starting, being checked, or in use
        by a call (which ends within milliseconds)."""
        return bool(pool.starting or pool.recycling or pool.in_use > waiting)

    def _release_stranded(self, pool: _Pool) -> None:
        """With nothing on its way, waiting calls start their own sandbox (the node budget stopped the refill)."""
        while pool.waiters and not self._one_on_its_way(pool, len(pool.waiters)):
            waiter = pool.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def _take(self, pool: _Pool) -> tuple[str, bool]:
        """A warm sandbox (a hit); else the next one returned or started, waiting in line; else a new one."""
        pool.in_use += 1
        pool.last_call = time.monotonic()
        pool.target = min(self._max_per_pool, max(pool.target, pool.in_use + self._min_warm))
        if pool.idle:
            pool.hits += 1
            sandbox_id = pool.idle.popleft()
            self._refill(pool)
            return sandbox_id, True
        self._refill(pool)
        taken: tuple[str, bool] | None = None
        if self._one_on_its_way(pool, len(pool.waiters) + 1):
            waiter: asyncio.Future[tuple[str, bool] | None] = asyncio.get_running_loop().create_future()
            pool.waiters.append(waiter)
            try:
                taken = await waiter
            except BaseException:  # the request went away; a sandbox handed over meanwhile goes to the next
                pool.in_use -= 1
                if waiter.done() and not waiter.cancelled() and (handed := waiter.result()) is not None:
                    self._offer(pool, handed[0], warm=handed[1])
                elif waiter in pool.waiters:
                    pool.waiters.remove(waiter)
                raise
        if taken is None:
            taken = (await self._create_for_call(pool)), False
        if taken[1]:
            pool.hits += 1
        else:
            pool.misses += 1
        return taken

    async def _create_for_call(self, pool: _Pool) -> str:
        try:
            return (await self._sandboxes.create(pool.template)).id
        except BaseException:
            pool.in_use -= 1
            raise

    async def _give_back(self, pool: _Pool, sandbox_id: str) -> None:
        """Reuse the sandbox only if the call left nothing behind; else replace it."""
        pool.in_use -= 1
        pool.recycling += 1
        reusable = False
        try:
            reusable = await self._sandboxes.call(sandbox_id, lambda edge: edge.recycle(sandbox_id))
        except Exception:  # any failure to check it (a read error, a gone sandbox) means it is not reused
            log.debug("recycle check of %s failed; replacing it", sandbox_id, exc_info=True)
        finally:
            pool.recycling -= 1
        if reusable and (pool.waiters or len(pool.idle) < self._max_per_pool):  # housekeeping trims idle pools
            pool.recycled += 1
            self._offer(pool, sandbox_id, warm=True)
            return
        pool.replaced += int(not reusable)
        with contextlib.suppress(CorralError):
            await self._sandboxes.kill(sandbox_id)
        self._refill(pool)
        self._release_stranded(pool)

    def housekeeping(self) -> None:
        """Shrink pools nobody called for a while back to their minimum."""
        now = time.monotonic()
        for pool in self._pools.values():
            if now - pool.last_call > _IDLE_SHRINK_S and pool.target > self._min_warm:
                pool.target = self._min_warm
                while len(pool.idle) > pool.target:
                    self._spawn(self._sandboxes.kill(pool.idle.pop()))

    def stats(self) -> list[PoolStats]:
        return [
            PoolStats(
                image=pool.template.image,
                memory_mb=pool.template.memory_mb,
                cpu=pool.template.cpu,
                network=pool.template.network is not None,
                warm=len(pool.idle),
                target=pool.target,
                in_use=pool.in_use,
                waiting=sum(not waiter.done() for waiter in pool.waiters),
                hits=pool.hits,
                misses=pool.misses,
                recycled=pool.recycled,
                replaced=pool.replaced,
            )  # fmt: skip
            for pool in self._pools.values()
        ]

    # -- calls ----------------------------------------------------------

    async def call(self, call: FnCallRequest) -> FnCallResult:
        if (call.cmd is None) == (call.code is None):
            raise InvalidRequest("a call needs exactly one of `cmd` (a command) or `code` (Python source)")
        if call.code is not None and call.stdin is not None:
            raise InvalidRequest("a code call takes `args`, not `stdin`")
        started = time.perf_counter()
        result, hit = await self.in_pool(call, lambda sandbox_id: self._run(sandbox_id, call))
        value, error, stdout = None, None, result.stdout
        if call.code is not None:
            stdout, _, tail = result.stdout.rpartition(_RESULT_MARKER)
            if tail:
                outcome = json.loads(tail)
                value, error = outcome.get("result"), outcome.get("error")
            else:
                stdout, error = result.stdout, error or "the call ended before main() returned"
        return FnCallResult(
            exit_code=result.exit_code, stdout=stdout, stderr=result.stderr, timed_out=result.timed_out,
            oom_killed=result.oom_killed, stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated, result=value, error=error, pool_hit=hit,
            duration_ms=(time.perf_counter() - started) * 1000,
        )  # fmt: skip

    async def in_pool(self, call: FnCallRequest, body: Callable[[str], Awaitable[T]]) -> tuple[T, bool]:
        """``body(sandbox_id)`` on a sandbox of ``call``'s pool (its image, limits and network), given back after;
        with whether it was a warm one. Only ``call``'s pool fields are used; ``body`` does the call's work."""
        pool = self._pool_for(call)
        for attempt in range(2):
            sandbox_id, hit = await self._take(pool)
            try:
                return await body(sandbox_id), hit
            except (SandboxGone, NotFound):
                if not hit or attempt:
                    raise  # a warm sandbox may have been killed meanwhile: take another once
            finally:
                self._spawn(self._give_back(pool, sandbox_id))
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._sandboxes.call(sandbox_id, lambda edge: edge.write_file(sandbox_id, path, data, 0o644))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._sandboxes.call(sandbox_id, lambda edge: edge.read_file(sandbox_id, path))

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await self._sandboxes.call(sandbox_id, lambda edge: edge.exec(sandbox_id, request))

    async def _run(self, sandbox_id: str, call: FnCallRequest) -> ExecResult:
        for path, text in call.files.items():
            await self.write_file(sandbox_id, path, text.encode())
        return await self.exec(sandbox_id, self._exec_request(call))

    @staticmethod
    def _exec_request(call: FnCallRequest) -> ExecRequest:
        if call.code is not None:
            stdin = json.dumps({"code": call.code, "args": call.args})
            cmd: str | list[str] = ["python3", "-I", "-B", "-c", _PYTHON_HARNESS]
        else:
            stdin, cmd = call.stdin, call.cmd  # type: ignore[assignment]
        return ExecRequest(
            cmd=cmd, stdin=stdin, timeout_s=call.timeout_s, output_cap_bytes=call.output_cap_bytes, cwd="/tmp"
        )

    async def batch(self, calls: list[FnCallRequest]) -> list[FnCallResult | dict[str, Any]]:
        """Many calls in one request; a failed call gives its error in place of a result."""
        slots = asyncio.Semaphore(_BATCH_CONCURRENCY)

        async def one(call: FnCallRequest) -> FnCallResult | dict[str, Any]:
            async with slots:
                try:
                    return await self.call(call)
                except CorralError as exc:
                    return exc.to_body()

        return list(await asyncio.gather(*(one(call) for call in calls)))

    async def run_code(self, request: RunCodeRequest) -> RunCodeResult:
        """Each test is its own isolated call; passed = exit 0 and, if given, the expected stdout."""
        argv = (
            ["python3", "-I", "-B", "-c", request.code]
            if request.language == "python"
            else ["bash", "-c", request.code]
        )
        calls = [
            FnCallRequest(
                cmd=argv,
                stdin=test.stdin,
                image=request.image or "debian-12",
                timeout_s=request.timeout_s,
                memory_mb=request.memory_mb,
            )  # fmt: skip
            for test in request.tests
        ]
        outcomes = await self.batch(calls)
        results = []
        for test, outcome in zip(request.tests, outcomes, strict=True):
            if not isinstance(outcome, FnCallResult):
                raise error_from_response(500, outcome)  # the call's own error class (503 stays 503)
            expected_ok = test.expected_stdout is None or outcome.stdout.rstrip() == test.expected_stdout.rstrip()
            results.append(
                RunCodeTestResult(
                    passed=outcome.exit_code == 0 and not outcome.timed_out and expected_ok,
                    exit_code=outcome.exit_code,
                    stdout=outcome.stdout,
                    stderr=outcome.stderr,
                    timed_out=outcome.timed_out,
                    duration_ms=outcome.duration_ms,
                )  # fmt: skip
            )
        return RunCodeResult(passed=sum(r.passed for r in results), total=len(results), tests=results)
