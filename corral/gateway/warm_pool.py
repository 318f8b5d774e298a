"""Warm pools: container and VM sandboxes started ahead of demand, which a create claims instead of starting one.

A container's start (crun create and start, its overlay, its cgroups: ~17 ms here) is most of a create, and a
VM's boot (or the restore of its boot template: ~0.3-6 s on TCG) all but the whole of it. A pool
per shape (the stack of layers, backend, runtime, cpu, memory, pids, CPU class, disk, setuid label, guard paths:
what the runtime fixes when the container starts) keeps such sandboxes running, unclaimed. A create of that
shape takes one: its record becomes the client's (labels, env, cwd, user, TTL, idle pause, node selector
excepted: see ``poolable``) and its edge applies the per-command settings (``Edge.claim``), so it is exactly the
sandbox a cold create would have made, only started earlier. A claimed sandbox is the client's; nothing goes
back to a pool (its end destroys it as any other). A create whose shape has no warm sandbox starts one cold, as
without pools; a node selector or a restore always does. A create with a network policy (E2B's default:
internet on) has a shape of its own, whose sandboxes start plugged into the node's network with nothing allowed, as
a create with ``network={"allow": []}`` would; the claim sets the client's allowlist (``Edge.claim``), the change a
running sandbox takes from ``set_network``. The same for a microvm or vm (its network card and namespace from its
start, closed until the claim).

Sizing: a pool's target is how many creates of its shape came in the last ``window_s`` (demand), and all
pools' warm sandboxes together stay within ``memory_budget_mb``, counted at their memory limit (what admission
reserves for them, so the pools never take more of the node's capacity than that). A pool above its target
(demand fell) is trimmed, oldest first. Refills start at most ``_REFILL_CONCURRENCY`` at once, and only while
no client create came in the last ``_QUIET_S``: client creates (and the first commands after them) go first.
Low CPU priority without nice (a process's niceness is inherited by the container it starts, which would still
run niced after the claim): a pool's sandbox runs at the lowest CPU weight of its cgroup until its claim gives it
its class's (``SandboxSpec.pool_member``, ``Backend.claimed``; corral/backends/common/qos.py).

Restarts: pool sandboxes are sandboxes with records (label ``corral.warm``), re-adopted like any other; at start
the pools take back the running ones whose shape pools still serve and destroy the rest (paused ones, or all of
them when pools are off). Never two claims of one sandbox: the pool hands an id out once (popped under the
event loop), and the record changes hands only while it is running (``StateStore.claim_many``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corral.api.errors import CorralError
from corral.api.models import CreateSandboxRequest, ExecRequest, NetworkPolicy, SandboxInfo, SandboxState
from corral.backends.base import SETUID_LABEL, LayerRef, setuid_allowed
from corral.gateway.fncall import POOL_LABEL as FNCALL_LABEL
from corral.gateway.service import WARM_LABEL, SandboxService
from corral.state.records import SandboxRecord

__all__ = ["WarmPools", "CLAIMED_NOTE"]

log = logging.getLogger(__name__)

CLAIMED_NOTE = "claimed from the warm pool"  # a pooled create's status_message: how a client can tell
_REFILL_CONCURRENCY = 4  # pool sandboxes starting at once (the edge's own create limit applies too)
_QUIET_S = 0.05  # refills wait until client creates paused this long (and the first exec after one is done)
_HOUSEKEEPING_INTERVAL_S = 1.0
_RETRY_AFTER_FAILURE_S = 5.0  # a pool whose refill failed (the node is full, say) waits this long
_CLAIM_TRIES = 4  # warm sandboxes tried per create before it starts cold (one that ended meanwhile is skipped)
# Record fields a claim gives the client's values (the rest was fixed when the sandbox started).
_CLAIMED_FIELDS = ("image", "user", "cwd", "env", "labels", "created_at", "expires_at", "ttl_counts_paused",
                   "idle_pause_s", "node_selector", "network")  # fmt: skip
# The creates with a network policy a pool serves: a sandbox started with a closed network takes its allowlist while
# it runs (a VM has its network card from its start; runsc sandboxes have loopback only).
_NETWORKED_CONTAINER_RUNTIMES = frozenset({"crun", "runc"})


@dataclass(frozen=True)
class Shape:
    """What the runtime fixes when a container starts: creates of one shape can share a pool."""

    layers: tuple[str, ...]  # mount keys, bottom first
    backend: str
    runtime: str
    cpu: float
    memory_mb: int
    pids_max: int
    qos: str
    disk_mb: int | None
    setuid_allowed: bool
    protected_paths: tuple[str, ...]
    sensitive_paths: tuple[str, ...]
    networked: bool  # started plugged into the node's network, nothing allowed (its own sysfs, an address)

    @classmethod
    def of_record(cls, record: SandboxRecord) -> Shape:
        return cls(
            layers=tuple(record.layers), backend=record.backend, runtime=record.runtime, cpu=record.cpu,
            memory_mb=record.memory_mb, pids_max=record.pids_max, qos=record.qos, disk_mb=record.disk_mb,
            setuid_allowed=setuid_allowed(record.labels), protected_paths=tuple(record.protected_paths or ()),
            sensitive_paths=tuple(record.sensitive_paths or ()), networked=record.network is not None,
        )  # fmt: skip

    def label(self) -> str:
        """The pool label's value on its sandboxes: a digest of the shape (records are matched by their fields)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


_PRIMER = ExecRequest(cmd="true", timeout_s=30)
POOLED_BACKENDS = frozenset({"container", "microvm", "vm"})
"""The backends pools serve: every stateful one (``fncall`` keeps pools of its own). A full ``vm`` is a whole
operating system's memory kept idle, so its pools are what the budget and the demand make them, as any other's:
nothing is started for a shape nobody asked for, and a vm's creates restore its boot template meanwhile."""


def poolable(request: CreateSandboxRequest, runtime: str) -> bool:
    """Creates a pool may serve: container, microvm and vm sandboxes placed by the scheduler (a node selector is
    set up at start and always starts cold), on loopback only or with a network policy (not a runsc container's,
    which has loopback only); not the pools' own (nor the fncall pools', which recycle theirs)."""
    networkable = request.backend != "container" or runtime in _NETWORKED_CONTAINER_RUNTIMES
    return (request.backend in POOLED_BACKENDS and not request.node_selector
            and (request.network is None or networkable)
            and WARM_LABEL not in request.labels and FNCALL_LABEL not in request.labels)  # fmt: skip


@dataclass
class _Pool:
    shape: Shape
    template: CreateSandboxRequest  # what its sandboxes are started with (prepared, labelled as the pool's)
    image_name: str
    layers: tuple[LayerRef, ...]
    idle: collections.deque[str] = field(default_factory=collections.deque)  # started, unclaimed; oldest first
    starting: int = 0
    retry_at: float = 0.0  # monotonic: no refill before (after a failed one)
    creates: collections.deque[float] = field(default_factory=collections.deque)  # monotonic times of its creates

    def demand(self, now: float, window_s: float) -> int:
        while self.creates and self.creates[0] < now - window_s:
            self.creates.popleft()
        return len(self.creates)


class WarmPools:
    """The node's warm pools, behind ``SandboxService.warm_pools`` (its creates claim through ``claim``)."""

    def __init__(self, sandboxes: SandboxService, *, memory_budget_mb: int, window_s: float) -> None:
        self._sandboxes = sandboxes
        self._budget_mb = memory_budget_mb
        self._window_s = window_s
        self._pools: dict[Shape, _Pool] = {}
        self._last_create = 0.0  # monotonic time of the last client create (claimed or cold)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        registry = sandboxes.metrics.registry
        self.claims = Counter(
            "corral_warm_pool_claims",
            "Creates a warm pool could serve, by outcome: hit (claimed "
            "a warm sandbox) or miss (none warm: started cold).",
            ["outcome"],
            registry=registry,
        )
        self.refills = Counter("corral_warm_pool_refills", "Pool sandboxes started, by outcome (started, failed).",
                               ["outcome"], registry=registry)  # fmt: skip
        self.discarded = Counter(
            "corral_warm_pool_discarded",
            "Unclaimed pool sandboxes destroyed, by reason: trimmed (demand fell), stale (not adoptable after a "
            "restart), unclaimable (paused under memory pressure, or ended by itself, while warm).",
            ["reason"],
            registry=registry,
        )
        for outcome in ("hit", "miss"):
            self.claims.labels(outcome)
        registry.register(_PoolCollector(self))

    @property
    def enabled(self) -> bool:
        return self._budget_mb > 0

    async def start(self) -> None:
        """Take back the pool sandboxes a restart left running (their shape's pool gets them again, with as much
        demand as there were of them) or destroy them; then keep the pools filled."""
        records = self._sandboxes.records_labelled(WARM_LABEL)
        for record in records:
            if not self.enabled or record.state != SandboxState.RUNNING.value:
                await self._discard(record.id, "stale")
                continue
            try:
                pool = self._pool(Shape.of_record(record), record.to_request(labels={}), record.image,
                                  self._sandboxes.layer_refs(record.layers))  # fmt: skip
            except CorralError:  # its layers are gone
                await self._discard(record.id, "stale")
                continue
            pool.idle.append(record.id)
            pool.creates.append(time.monotonic())
        if records:
            log.info("warm pools: %d pool sandboxes after the restart, %d taken back", len(records), self.warm())
        if self.enabled:
            self._spawn(self._keep_filled())

    async def close(self) -> None:
        """Stop refilling; the unclaimed sandboxes keep running (a restart takes them back)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coroutine: Any) -> None:  # noqa: ANN401 - any coroutine
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _pool(self, shape: Shape, request: CreateSandboxRequest, image_name: str,
              layers: tuple[LayerRef, ...]) -> _Pool:  # fmt: skip
        pool = self._pools.get(shape)
        if pool is None:
            labels = {WARM_LABEL: shape.label(), **({SETUID_LABEL: "allowed"} if shape.setuid_allowed else {})}
            closed = NetworkPolicy(allow=[]) if shape.networked else None  # the claim sets the client's allowlist
            template = request.model_copy(
                update={"labels": labels, "ttl_s": None, "idle_pause_s": None, "network": closed}
            )
            pool = self._pools[shape] = _Pool(shape, template, image_name, layers)
        return pool

    # -- claims -------------------------------------------------------------

    async def claim(
        self, request: CreateSandboxRequest, image_name: str, layers: tuple[LayerRef, ...]
    ) -> SandboxInfo | None:
        """A warm sandbox of the create's shape made the client's, or None (the create starts one cold)."""
        runtime = request.runtime or self._sandboxes.default_runtime
        if not self.enabled or not poolable(request, runtime):
            return None
        shape = Shape(
            layers=tuple(layer.mount_key for layer in layers), backend=request.backend, runtime=runtime,
            cpu=request.cpu, memory_mb=request.memory_mb, pids_max=request.pids_max, qos=request.qos,
            disk_mb=request.disk_mb, setuid_allowed=setuid_allowed(request.labels),
            protected_paths=tuple(request.protected_paths), sensitive_paths=tuple(request.sensitive_paths),
            networked=request.network is not None,
        )  # fmt: skip
        pool = self._pool(shape, request, image_name, layers)
        now = self._last_create = time.monotonic()
        started_s = time.perf_counter()
        pool.creates.append(now)
        for _ in range(_CLAIM_TRIES):
            if not pool.idle:
                break
            sandbox_id = pool.idle.popleft()  # handed out once: no other claim sees it from here on
            info = await self._hand_over(sandbox_id, request, image_name, layers)
            if info is not None:
                self.claims.labels("hit").inc()
                self._sandboxes.metrics.created(request.backend, time.perf_counter() - started_s)
                self._wake.set()
                return info
        self.claims.labels("miss").inc()
        self._wake.set()
        return None

    async def _hand_over(self, sandbox_id: str, request: CreateSandboxRequest, image_name: str,
                         layers: tuple[LayerRef, ...]) -> SandboxInfo | None:  # fmt: skip
        """The record first (from then on the sandbox is the client's, whatever happens next: a restart adopts it
        with the client's settings), then the edge's per-command settings. None if it ended meanwhile."""
        spec, record = self._sandboxes.spec_and_record(request, image_name, layers, sandbox_id)
        values = {name: getattr(record, name) for name in _CLAIMED_FIELDS} | {"status_message": CLAIMED_NOTE}
        if not await self._sandboxes.claim_record(sandbox_id, values):
            await self._discard(sandbox_id, "unclaimable")  # paused (memory pressure) or ended meanwhile
            return None
        try:
            await self._sandboxes.edge(sandbox_id).claim(sandbox_id, spec)
        except CorralError as exc:  # gone under us: the client's now, so it ends as the client's sandbox would
            log.warning("warm sandbox %s could not be handed over: %s", sandbox_id, exc.message)
            await self._sandboxes.kill(sandbox_id)
            return None
        return record.to_info(state=SandboxState.RUNNING.value, status_message=CLAIMED_NOTE)

    # -- refills ------------------------------------------------------------

    def warm(self) -> int:
        return sum(len(pool.idle) for pool in self._pools.values())

    def _held_mb(self) -> int:
        return sum((len(pool.idle) + pool.starting) * pool.shape.memory_mb for pool in self._pools.values())

    async def _keep_filled(self) -> None:
        """Trim pools above their demand; start sandboxes for those below, within the budget, when creates pause."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _HOUSEKEEPING_INTERVAL_S)
            self._wake.clear()
            try:
                await self._trim()
                while (quiet := time.monotonic() - self._last_create) < _QUIET_S:
                    await asyncio.sleep(_QUIET_S - quiet)
                self._refill()
            except Exception:
                log.exception("warm pools: a refill round failed; retrying")

    async def _trim(self) -> None:
        """Pools above their demand lose their oldest sandboxes; a pool with no demand and nothing left goes."""
        now = time.monotonic()
        for shape, pool in list(self._pools.items()):
            demand = pool.demand(now, self._window_s)
            extra = len(pool.idle) + pool.starting - demand
            while extra > 0 and pool.idle:
                await self._discard(pool.idle.popleft(), "trimmed")
                extra -= 1
            if not demand and not pool.idle and not pool.starting:
                del self._pools[shape]

    def _refill(self) -> None:
        now = time.monotonic()
        starting = sum(pool.starting for pool in self._pools.values())
        for pool in sorted(self._pools.values(), key=lambda p: -p.demand(now, self._window_s)):
            wanted = pool.demand(now, self._window_s) - len(pool.idle) - pool.starting
            while (pool.retry_at <= now and wanted > 0 and starting < _REFILL_CONCURRENCY
                   and self._held_mb() + pool.shape.memory_mb <= self._budget_mb):  # fmt: skip
                pool.starting += 1
                starting += 1
                wanted -= 1
                self._spawn(self._start_one(pool))

    async def _start_one(self, pool: _Pool) -> None:
        try:
            info = await self._sandboxes.create_prepared(pool.template, pool.image_name, pool.layers)
        except CorralError as exc:
            self.refills.labels("failed").inc()
            pool.retry_at = time.monotonic() + _RETRY_AFTER_FAILURE_S
            log.warning("warm pool could not start a sandbox (next try in %g s): %s", _RETRY_AFTER_FAILURE_S,
                        exc.message)  # fmt: skip
        else:
            if not await self._prime(info.id):  # every pool sandbox, whatever its backend
                pool.retry_at = time.monotonic() + _RETRY_AFTER_FAILURE_S  # a sandbox that did not answer: as above
                return
            self.refills.labels("started").inc()
            pool.idle.append(info.id)
        finally:
            pool.starting -= 1
            self._wake.set()

    async def _prime(self, sandbox_id: str) -> bool:
        """Run ``true`` in a new pool sandbox (on the edge: no trajectory step, nothing the client sees) so the claim's
        first command does not pay for the sandbox's first fork and exec of its shell. A container's costs ~0.2 ms
        more than its next (the claim's first exec 2.74-2.86 ms primed vs 2.97-3.04, `corral bench warm-pool`, 3
        alternating runs, 2026-12-05). Under TCG the code cache of a
        guest restored from its boot template starts empty: without this the claim's first exec took 110 ms
        (median of 6 claims, 1-core guests; the next ones 27-38 ms), with it 34 ms (by hand, not a benchmark row).
        With the audit after it, as a client's command has: its walk of the guest's writable layer starts cold too
        (measured when that walk was the project's busybox: the claim's first exec took 22-25 ms against 16-18 for
        the next one without it, 19-21 against 16 with it, `corral bench warm-pool --backend microvm`, 2026-12-05,
        3 and 2 runs; the agent walks it itself now). The audit's findings are
        dropped: `true` changes nothing, and the sandbox is nobody's yet. Whatever its exit (an image with no
        /bin/sh answers 127, and is as claimable as any), the sandbox answered; False (and it is discarded) if it
        did not."""
        try:
            await self._sandboxes.edge(sandbox_id).exec_audited(sandbox_id, _PRIMER)
            return True
        except CorralError as exc:
            log.warning("warm pool: %s did not run its first command: %s", sandbox_id, exc.message)
        self.refills.labels("failed").inc()
        await self._discard(sandbox_id, "unclaimable")
        return False

    async def _discard(self, sandbox_id: str, reason: str) -> None:
        self.discarded.labels(reason).inc()
        try:
            await self._sandboxes.kill(sandbox_id)
        except CorralError as exc:
            log.warning("warm pool could not destroy %s: %s", sandbox_id, exc.message)

    def levels(self) -> Iterator[tuple[_Pool, int]]:
        now = time.monotonic()
        for pool in self._pools.values():
            yield pool, pool.demand(now, self._window_s)


class _PoolCollector(Collector):
    """Pool sizes as read at scrape time (levels, as gateway/metrics.py keeps them)."""

    def __init__(self, pools: WarmPools) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["image", "backend", "memory_mb", "shape"]
        sizes = GaugeMetricFamily("corral_warm_pool_sandboxes", "Unclaimed pool sandboxes by state (warm: ready to "
                                  "claim; starting).", labels=[*labels, "state"])  # fmt: skip
        target = GaugeMetricFamily("corral_warm_pool_target", "What a pool fills up to now: its creates in the "
                                   "demand window (CORRAL_WARM_POOL_WINDOW_S).", labels=labels)  # fmt: skip
        for pool, demand in self._pools.levels():
            key = [pool.image_name, pool.shape.backend, str(pool.shape.memory_mb), pool.shape.label()]
            sizes.add_metric([*key, "warm"], len(pool.idle))
            sizes.add_metric([*key, "starting"], pool.starting)
            target.add_metric(key, demand)
        yield from (sizes, target)
