"""Warm pools (corral/gateway/warm_pool.py) through a real server, real crun containers and the SDK.

One server of this module's own with pools on (the session server has them off, the default), and its restart
at the end. Each test uses its own memory size, so its own shape and pool: the tests do not share pools.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import corral
from corral.backends.common import qos
from corral.backends.common.host import runtime_dirs_of, runtime_state_root
from corral.embedded import EmbeddedServer
from corral.gateway.warm_pool import CLAIMED_NOTE
from corral.testing.leftovers import find_leftovers
from tests.tcp_mirror import plugged_mirror

# The budget holds every pool of this module at its demand, with room (each test has a shape of its own; at 3 GB
# the last test's pool, of the eleventh shape, did not fill).
# Room for a warm sandbox of every shape this module's tests make, two full-vm shapes (448 and 464 MiB) among them:
# with 4096 the networked full vm's pool, last to be made, found the budget held by the others' and never filled.
WARM_ENV = {"CORRAL_WARM_POOL_MEMORY_MB": "6144", "CORRAL_WARM_POOL_WINDOW_S": "600"}
TEARDOWN_SHAPE_MB = 34  # no test's: the fixture's own pool when a test run alone left none
MIRROR = "10.88.200.3"  # a "package mirror" in a network namespace of this module's own, plugged into the server's


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    proc = EmbeddedServer(tmp_path_factory.mktemp("warm-server"), env={**test_env, **WARM_ENV})
    proc.start()
    warm: set[str] = set()
    try:
        yield proc
        warm = _warm_ids(proc) | _warm_guests(proc)
        if not warm:  # the module's tests run alone can end with every pool claimed: fill one for the check below
            with proc.client() as c:
                for made in _fill(proc, c, TEARDOWN_SHAPE_MB, 1):
                    made.kill()
            warm = _warm_ids(proc)
    finally:
        # The shutdown deletes the pools' sandboxes the stopped server left running (a restart would take them
        # back), and says so on stderr: closed here (a bench piped into `head`), where a print that raised once
        # left the rest running. Each killed VM guest's cgroup goes too: a killed QEMU's leader is a zombie before
        # its vCPU threads have gone, and removing the cgroup then found it busy and left it behind.
        closed = io.StringIO()
        closed.close()
        with contextlib.redirect_stderr(closed):
            proc.shutdown()
    assert warm, "no pool sandbox was left for the shutdown to delete"
    assert not (left := find_leftovers(proc.data_dir, warm)), left


@pytest.fixture
def client(pooled: EmbeddedServer) -> Iterator[corral.Client]:
    with pooled.client() as c:
        yield c


@pytest.fixture(scope="module")
def mirror(pooled: EmbeddedServer) -> Iterator[str]:
    """A TCP service in a network namespace of this module's own, plugged into the pooled server's network."""
    with plugged_mirror(pooled, "wmirror", MIRROR) as address:
        yield address


def _metric(server: EmbeddedServer, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry these labels."""
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    assert response.status_code == 200, response.text
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def _warm(server: EmbeddedServer, memory_mb: int) -> float:
    return _metric(server, "corral_warm_pool_sandboxes", memory_mb=str(memory_mb), state="warm")


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _fill(server: EmbeddedServer, client: corral.Client, memory_mb: int, count: int) -> list[corral.Sandbox]:
    """``count`` creates of the shape (the demand), then wait for the pool to hold as many warm sandboxes."""
    made = [client.create("busybox", memory_mb=memory_mb, ttl_s=300) for _ in range(count)]
    _wait_for(lambda: _warm(server, memory_mb) >= count)
    return made


def test_a_create_claims_a_warm_sandbox_with_its_own_settings(pooled: EmbeddedServer, client: corral.Client) -> None:
    first = client.create("busybox", memory_mb=48, ttl_s=300)
    assert first.info.status_message != CLAIMED_NOTE  # the shape's first create: nothing warm yet, cold
    first.kill()
    _wait_for(lambda: _warm(pooled, 48) >= 1)
    hits = _metric(pooled, "corral_warm_pool_claims_total", outcome="hit")
    started = time.time()
    sandbox = client.create(
        "busybox", memory_mb=48, ttl_s=120, env={"TASK": "t-17"}, cwd="/tmp", labels={"job": "warm-test", "k": "v"}
    )
    try:
        info = sandbox.info
        assert info.status_message == CLAIMED_NOTE
        assert _metric(pooled, "corral_warm_pool_claims_total", outcome="hit") == hits + 1
        assert info.labels == {"job": "warm-test", "k": "v"}  # the pool's label is gone, the client's are there
        assert info.expires_at is not None and started + 119 <= info.expires_at <= time.time() + 121
        assert info.created_at >= started
        result = sandbox.exec("echo $TASK; pwd; id -u")
        assert result.stdout == "t-17\n/tmp\n0\n"
        assert sandbox.id in {s.id for s in client.list(labels={"job": "warm-test"})}
        assert client.get(sandbox.id).info.status_message == CLAIMED_NOTE
    finally:
        sandbox.kill()
    assert client.get(sandbox.id).info.state == "ended"


def test_pool_sandboxes_run_at_the_lowest_cpu_weight_until_claimed(
    pooled: EmbeddedServer, client: corral.Client
) -> None:
    """A refill must not slow the node's clients' sandboxes down, a claimed one's first commands least: a pool's
    sandbox starts and waits at the pool's weight; the claim gives it its class's."""
    before = _warm_ids(pooled)
    for made in _fill(pooled, client, 44, 1):
        made.kill()
    # This shape's: another test's pool may be refilling meanwhile (seen once in a full run).
    (warm_id,) = {i for i in _warm_ids(pooled) - before if _memory_limit_mb("corral", i) == 44}
    assert _cpu_weight("corral", warm_id) == qos.POOL_WEIGHT
    sandbox = client.create("busybox", memory_mb=44, ttl_s=300)
    try:
        assert sandbox.id == warm_id and sandbox.info.status_message == CLAIMED_NOTE
        assert _cpu_weight("corral", warm_id) == qos.weight_of("latency")
        cold = client.create("busybox", memory_mb=44, ttl_s=300, network={"allow": []})  # always cold
        assert cold.info.status_message != CLAIMED_NOTE and _cpu_weight("corral", cold.id) == qos.weight_of("latency")
        cold.kill()
    finally:
        sandbox.kill()


def _pooled_guests(server: EmbeddedServer, client: corral.Client, image: str, backend: str, memory_mb: int,
                   leave: str) -> set[str]:  # fmt: skip
    """The shape's first create (a boot, or a template's restore) runs ``leave``, ends, and makes the shape's pool:
    the pool's guests once one is warm, each waiting at the lowest CPU weight."""
    first = client.create(image, backend=backend, memory_mb=memory_mb, ttl_s=300)
    assert first.info.status_message != CLAIMED_NOTE
    first.exec(leave)
    first.kill()
    _wait_for(lambda: _warm(server, memory_mb) >= 1, timeout_s=180)
    assert _metric(server, "corral_warm_pool_sandboxes", backend=backend, memory_mb=str(memory_mb), state="warm") >= 1
    warm = _warm_guests(server) - {first.id}
    assert warm and {_cpu_weight("corral-vm", i) for i in warm} == {qos.POOL_WEIGHT}
    return warm


def test_a_microvm_create_claims_a_booted_guest(pooled: EmbeddedServer, client: corral.Client) -> None:
    """A microvm pool holds booted guests: a create of its shape claims one (no boot), whose agent takes the
    client's env and working dir, and which holds nothing of the guest the shape's first create used."""
    warm = _pooled_guests(
        pooled, client, "busybox", "microvm", 256, "echo first > /root/mark; sleep 600 >/dev/null 2>&1 &"
    )
    started = time.perf_counter()
    sandbox = client.create("busybox", backend="microvm", memory_mb=256, ttl_s=300, env={"TASK": "vm-3"}, cwd="/tmp")
    try:
        result = sandbox.exec(
            'echo "$TASK"; pwd; uname -r; cat /root/mark 2>/dev/null; ps -o args | grep -c "[s]leep 600"'
        )
        took_ms = (time.perf_counter() - started) * 1000
        print(f"\npooled microvm create → first exec: {took_ms:.1f} ms")
        info = sandbox.info
        assert info.status_message == CLAIMED_NOTE and info.backend == "microvm" and sandbox.id in warm
        assert _cpu_weight("corral-vm", sandbox.id) == qos.V2_DEFAULT_WEIGHT
        lines = result.stdout.splitlines()
        assert lines[:2] == ["vm-3", "/tmp"] and lines[2] != os.uname().release, result  # the guest's own kernel
        assert lines[3:] == ["0"], result  # no mark, no process of the first guest
    finally:
        sandbox.kill()


def test_a_full_vm_create_claims_a_booted_system(pooled: EmbeddedServer, client: corral.Client) -> None:
    """A full vm's pool holds booted guests of the shape's whole disk too: a create claims one (no boot, no
    restore), with the client's settings, and nothing of the system the shape's first create ran."""
    warm = _pooled_guests(pooled, client, "debian-12", "vm", 448, "echo first > /root/mark")
    sandbox = client.create("debian-12", backend="vm", memory_mb=448, ttl_s=300, env={"TASK": "vm-4"}, cwd="/tmp")
    try:
        result = sandbox.exec('echo "$TASK"; pwd; hostname; cat /root/mark 2>/dev/null; true')
        info = sandbox.info
        assert info.status_message == CLAIMED_NOTE and info.backend == "vm" and sandbox.id in warm
        assert _cpu_weight("corral-vm", sandbox.id) == qos.V2_DEFAULT_WEIGHT
        assert result.stdout.splitlines() == ["vm-4", "/tmp", sandbox.id[-12:]], result  # no mark of the first
    finally:
        sandbox.kill()


def test_claims_never_share_a_sandbox_nor_what_a_client_left(pooled: EmbeddedServer, client: corral.Client) -> None:
    for made in _fill(pooled, client, 56, 4):
        made.kill()
    first, second = (client.create("busybox", memory_mb=56, ttl_s=300) for _ in range(2))
    assert first.id != second.id
    assert first.info.status_message == second.info.status_message == CLAIMED_NOTE
    first.files.write("/tmp/secret", "first's answer")
    first.exec("sleep 600 >/dev/null 2>&1 &")
    # The shell answers once it has forked; its child may still be in its exec of sleep (ps shows "[sh]").
    _wait_for(lambda: "sleep 600" in first.exec("ps -o args").stdout)
    seen = {first.id, second.id}
    first.kill()
    assert "sleep 600" not in second.exec("ps -o args").stdout
    assert second.exec("cat /tmp/secret").exit_code != 0
    for _ in range(3):  # later claims get other sandboxes, never the one the first client used
        later = client.create("busybox", memory_mb=56, ttl_s=300)
        assert later.id not in seen
        seen.add(later.id)
        assert later.exec("cat /tmp/secret; ps -o args").stdout.count("sleep 600") == 0
        later.kill()
    second.kill()


def test_concurrent_creates_never_get_the_same_sandbox(pooled: EmbeddedServer, client: corral.Client) -> None:
    used = _fill(pooled, client, 36, 4)
    for sandbox in used:
        sandbox.kill()

    def create(_: int) -> corral.Sandbox:
        with pooled.client() as own:
            return own.create("busybox", memory_mb=36, ttl_s=300)

    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        made = list(threads.map(create, range(8)))  # more than are warm: some claim, the rest start cold
    try:
        ids = [sandbox.id for sandbox in made]
        assert len(set(ids)) == 8
        claimed = {sandbox.id for sandbox in made if sandbox.info.status_message == CLAIMED_NOTE}
        assert len(claimed) >= 1
        assert not claimed & {sandbox.id for sandbox in used}  # a sandbox a client used is never handed out again
        assert all(client.get(i).info.state == "running" for i in ids)
    finally:
        for sandbox in made:
            client.kill(sandbox.id)  # its own client is closed


def test_the_pool_refills_and_an_empty_pool_falls_back_to_cold(pooled: EmbeddedServer, client: corral.Client) -> None:
    misses = _metric(pooled, "corral_warm_pool_claims_total", outcome="miss")
    cold = client.create("busybox", memory_mb=40, ttl_s=300)  # a shape no create asked for before: its pool is empty
    assert cold.info.status_message != CLAIMED_NOTE
    assert cold.exec("echo cold").stdout == "cold\n"
    assert _metric(pooled, "corral_warm_pool_claims_total", outcome="miss") == misses + 1
    cold.kill()
    for made in _fill(pooled, client, 40, 2):
        made.kill()
    refills = _metric(pooled, "corral_warm_pool_refills_total", outcome="started")
    taken = [client.create("busybox", memory_mb=40, ttl_s=300) for _ in range(2)]
    assert all(s.info.status_message == CLAIMED_NOTE for s in taken)
    _wait_for(lambda: _metric(pooled, "corral_warm_pool_refills_total", outcome="started") >= refills + 2)
    _wait_for(lambda: _warm(pooled, 40) >= 2)  # back to its demand
    assert not {s.id for s in taken} & _warm_ids(pooled)
    for sandbox in taken:
        sandbox.kill()


def test_an_image_without_a_shell_is_pooled_too(pooled: EmbeddedServer, client: corral.Client, tmp_path: Path) -> None:
    """A pool sandbox runs a first command (``sh -c true``) before it counts as warm, to take the first fork and
    exec off the claim's first command; in an image without /bin/sh (FROM scratch) that command fails (127), yet the
    sandbox is as good as any: it goes into the pool, not away (discarding it made the pool start one after another,
    never warm, for as long as the server ran)."""
    (tmp_path / "hello.txt").write_text("hi\n")
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY hello.txt /\n")
    client.images.build_dockerfile("pool-scratch", tmp_path / "Dockerfile")
    discarded = _metric(pooled, "corral_warm_pool_discarded_total", reason="unclaimable")
    first = client.create("pool-scratch", memory_mb=68, ttl_s=300)
    first.kill()
    _wait_for(lambda: _warm(pooled, 68) >= 1)
    time.sleep(0.5)  # a refill would have gone round again by now had the sandbox been discarded
    assert _metric(pooled, "corral_warm_pool_discarded_total", reason="unclaimable") == discarded
    taken = client.create("pool-scratch", memory_mb=68, ttl_s=300)
    try:
        assert taken.info.status_message == CLAIMED_NOTE
        assert taken.files.read("/hello.txt") == b"hi\n"
    finally:
        taken.kill()


def test_unpoolable_creates_start_cold(pooled: EmbeddedServer, client: corral.Client) -> None:
    for made in _fill(pooled, client, 52, 1):
        made.kill()
    selected = client.create("busybox", memory_mb=52, ttl_s=300, node_selector={})
    assert selected.info.status_message == CLAIMED_NOTE  # an empty selector is no selector
    selected.kill()
    _wait_for(lambda: _warm(pooled, 52) >= 1)
    networked = client.create("busybox", memory_mb=52, ttl_s=300, network={"allow": []})
    assert networked.info.status_message != CLAIMED_NOTE  # a networked create's shape is another pool's
    networked.kill()


def test_a_network_create_claims_a_sandbox_started_closed_and_gets_its_allowlist(
    pooled: EmbeddedServer, client: corral.Client, mirror: str
) -> None:
    """A container create with a network policy has pools of its own, whose sandboxes start plugged in with nothing
    allowed; the claim sets the client's allowlist: the sandbox reaches what it names and nothing else, lists its
    interface in its own /sys as a cold network create does, and reports the client's policy. A loopback-only
    create of the same size never gets one of them, nor a networked create a loopback-only one."""
    allowed = {"allow": [{"cidr": mirror, "ports": [8080], "protocol": "tcp"}]}
    first = client.create("busybox", memory_mb=62, ttl_s=300, network=allowed)
    assert first.info.status_message != CLAIMED_NOTE  # its shape's first create: nothing warm yet
    first.kill()
    _wait_for(lambda: _warm(pooled, 62) >= 1)
    plain = client.create("busybox", memory_mb=62, ttl_s=300)
    assert plain.info.status_message != CLAIMED_NOTE  # the only warm sandbox of that size is a networked one
    plain.kill()

    sandbox = client.create("busybox", memory_mb=62, ttl_s=300, network=allowed)
    try:
        _assert_claimed_with_the_allowlist(client, sandbox, mirror)
        listed = sandbox.exec("ls /sys/class/net").stdout.split()
        links = sandbox.exec("ip -o link | cut -d: -f2 | cut -d@ -f1").stdout.split()
        assert len(listed) == 2 and sorted(listed) == sorted(links), (listed, links)
    finally:
        sandbox.kill()

    # Both pools filled (the networked one's demand is 2, the loopback one's 1): each create gets its own kind.
    _wait_for(lambda: _warm(pooled, 62) >= 3)
    claims = [client.create("busybox", memory_mb=62, ttl_s=300, network=allowed) for _ in range(2)]
    claims.append(client.create("busybox", memory_mb=62, ttl_s=300))
    try:
        assert [made.info.status_message for made in claims] == [CLAIMED_NOTE] * 3
        fetched = [made.exec(_fetch(mirror), timeout_s=10).stdout for made in claims]
        assert fetched == ["ok from mirror\n", "ok from mirror\n", ""]
        assert claims[2].exec("ip -o link | cut -d: -f2").stdout.split() == ["lo"]
        assert claims[2].network().address is None
    finally:
        for made in claims:
            made.kill()


def test_a_networked_microvm_create_claims_a_booted_guest_and_gets_its_allowlist(
    pooled: EmbeddedServer, client: corral.Client, mirror: str
) -> None:
    """A microvm's network card and namespace come with its start: a networked shape's guests boot closed, and the
    claim sets the client's allowlist as for a container."""
    _claim_a_networked_guest(pooled, client, mirror, "busybox", "microvm", 240, warm_within_s=180, timeout_s=15)


def test_a_networked_full_vm_create_claims_a_booted_system_and_gets_its_allowlist(
    pooled: EmbeddedServer, client: corral.Client, mirror: str
) -> None:
    """A full vm's pool of a networked shape: its systems boot closed (their card up, nothing allowed), and the
    claim sets the client's allowlist, which the booted system's network then follows."""
    _claim_a_networked_guest(pooled, client, mirror, "debian-12", "vm", 464, warm_within_s=240, timeout_s=20,
                             fetch=_fetch_in_bash)  # fmt: skip


def _claim_a_networked_guest(
    pooled: EmbeddedServer,
    client: corral.Client,
    mirror: str,
    image: str,
    backend: str,
    memory_mb: int,
    *,
    warm_within_s: float,
    timeout_s: float,
    fetch: Callable[..., str] | None = None,
) -> None:
    """The shape's first create starts cold and makes its pool; once a guest is warm, a create claims it with the
    client's allowlist (``_assert_claimed_with_the_allowlist``)."""
    allowed = {"allow": [{"cidr": mirror, "ports": [8080], "protocol": "tcp"}]}
    first = client.create(image, backend=backend, memory_mb=memory_mb, ttl_s=300, network=allowed)
    assert first.info.status_message != CLAIMED_NOTE
    first.kill()
    _wait_for(lambda: _warm(pooled, memory_mb) >= 1, timeout_s=warm_within_s)
    sandbox = client.create(image, backend=backend, memory_mb=memory_mb, ttl_s=300, network=allowed)
    try:
        _assert_claimed_with_the_allowlist(client, sandbox, mirror, timeout_s=timeout_s, fetch=fetch or _fetch)
    finally:
        sandbox.kill()


def _fetch(mirror: str, port: int = 8080) -> str:
    return f"echo hi | nc -w 3 {mirror} {port}"


def _fetch_in_bash(mirror: str, port: int = 8080) -> str:
    """``_fetch`` for a system without nc: bash's /dev/tcp, 3 s at most."""
    return f"timeout 3 bash -c 'exec 3<>/dev/tcp/{mirror}/{port}; echo hi >&3; head -n 1 <&3' 2>/dev/null"


def _assert_claimed_with_the_allowlist(
    client: corral.Client,
    sandbox: corral.Sandbox,
    mirror: str,
    timeout_s: float = 10,
    fetch: Callable[..., str] = _fetch,
) -> None:
    """Claimed; reaches the mirror's allowed port, not another (denied and counted); reports the client's policy."""
    assert sandbox.info.status_message == CLAIMED_NOTE
    assert sandbox.exec(fetch(mirror), timeout_s=timeout_s).stdout == "ok from mirror\n"
    assert sandbox.exec(fetch(mirror, 8081), timeout_s=timeout_s).stdout == ""
    status = sandbox.network()
    assert status.address is not None and status.address.startswith("10.88.")
    assert [rule.model_dump(exclude_none=True) for rule in status.allow or []] == [
        {"cidr": mirror, "ports": [8080], "protocol": "tcp", "action": "allow"}
    ]
    assert status.denied_egress_packets > 0  # the port it was not given
    assert client.get(sandbox.id).info.network == sandbox.info.network is not None


def test_a_restart_takes_warm_sandboxes_back_or_destroys_them(pooled: EmbeddedServer, client: corral.Client) -> None:
    """Last in the module: it restarts the module's server. The running pool sandboxes go back to their pools; a
    paused one (it would not answer a claim at once) is destroyed: no container, no directory, its record ended.
    (With pools off every one goes that way: the same branch of ``WarmPools.start``.) It makes the pools it needs
    itself: run alone or after the module's other tests, it tests the same."""
    for made in _fill(pooled, client, 60, 2) + _fill(pooled, client, 58, 1):
        made.kill()
    warm_before = _warm_ids(pooled)
    assert len(warm_before) >= 3
    # One of the 58 MB pool's, not the 60 MB pool's: that pool would come back with one sandbox, and its demand of one.
    paused_id = next(i for i in sorted(warm_before) if client.get(i).info.memory_mb == 58)
    client.get(paused_id).pause()
    pooled.stop()
    pooled.start()
    with pooled.client() as after:
        assert after.get(paused_id).info.state == "ended"
        assert _metric(pooled, "corral_warm_pool_discarded_total", reason="stale") == 1  # the new process's count
        assert paused_id not in _containers(pooled.data_dir)
        assert not (pooled.data_dir / "sandboxes" / paused_id).exists()
        assert not (runtime_dirs_of(pooled.data_dir) / paused_id).exists()
        assert _containers(pooled.data_dir) >= warm_before - {paused_id}  # the others adopted, none destroyed
        _wait_for(lambda: _warm(pooled, 60) >= 2)
        taken = after.create("busybox", memory_mb=60, ttl_s=300)
        assert taken.info.status_message == CLAIMED_NOTE
        assert taken.id in warm_before  # one started before the restart
        assert _cpu_weight("corral", taken.id) == qos.weight_of("latency")  # adopted as a pool's, claimed as ours
        assert taken.exec("echo back").stdout == "back\n"
        taken.kill()


def _warm_ids(server: EmbeddedServer) -> set[str]:
    """Sandboxes of the server that no client holds: its containers less its listed (claimed) sandboxes."""
    with server.client() as c:
        return _containers(server.data_dir) - {s.id for s in c.list()}


def _containers(data_dir: Path) -> set[str]:
    """The containers crun runs for this server (its state directory), by id."""
    listing = subprocess.run(
        ["crun", "--root", str(runtime_state_root(data_dir, "crun")), "list", "--quiet"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return set(listing.stdout.split())


def _warm_guests(server: EmbeddedServer) -> set[str]:
    """The server's VM sandboxes that no client holds (a VM sandbox's directory is under the data dir's vms/)."""
    vms = server.data_dir / "vms"
    if not vms.is_dir():  # made by the server's first VM: none when only containers ran
        return set()
    with server.client() as c:
        return {d.name for d in vms.iterdir() if d.is_dir()} - {s.id for s in c.list()}


def _memory_limit_mb(tier: str, sandbox_id: str) -> int | None:
    """A sandbox's cgroup memory limit in MiB, as the kernel has it; None once the sandbox is gone."""
    v1 = Path("/sys/fs/cgroup/memory")
    limit = (
        v1 / tier / sandbox_id / "memory.limit_in_bytes"
        if v1.is_dir()
        else Path("/sys/fs/cgroup") / tier / sandbox_id / "memory.max"
    )
    try:
        return int(limit.read_text()) >> 20
    except FileNotFoundError:
        return None


def _cpu_weight(tier: str, sandbox_id: str) -> int:
    """A sandbox's cgroup CPU weight in v2 units, as the kernel has it (v1: cpu.shares through qos's map)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if v1.is_dir():
        return qos.shares_to_weight(int((v1 / tier / sandbox_id / "cpu.shares").read_text()))
    return int((Path("/sys/fs/cgroup") / tier / sandbox_id / "cpu.weight").read_text())
