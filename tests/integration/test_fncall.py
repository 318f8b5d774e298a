"""The fncall backend: short calls from pre-warmed pools, each as isolated as a fresh sandbox."""

from __future__ import annotations

import time

import httpx
import pytest

import corral
from corral.embedded import EmbeddedServer


def test_command_call(client: corral.Client) -> None:
    result = client.fncall("echo $((6*7)); echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "42\n", "err\n")


def test_python_call_returns_json(client: corral.Client) -> None:
    result = client.fncall(code="def main(a, b):\n    print('side note')\n    return {'sum': a + b}", args=[2, 40])
    assert result.result == {"sum": 42} and result.error is None and result.stdout == "side note\n"
    failing = client.fncall(code="def main():\n    raise ValueError('bad answer')")
    assert failing.error == "ValueError: bad answer" and failing.result is None


def test_files_placed_before_the_call(client: corral.Client) -> None:
    result = client.fncall("cat /work/in.txt | tr a-z A-Z", files={"/work/in.txt": "hello"})
    assert result.stdout == "HELLO"


def test_writes_are_not_seen_by_the_next_call(client: corral.Client) -> None:
    client.fncall("echo secret > /tmp/leak; echo x > /dev/shm/leak; mkdir -p /work && echo y > /work/leak")
    for _ in range(5):  # whichever pooled sandbox serves it
        assert client.fncall("cat /tmp/leak /dev/shm/leak /work/leak 2>/dev/null; true").stdout == ""


def test_background_processes_do_not_survive_the_call(client: corral.Client) -> None:
    client.fncall("sleep 300 & sleep 301 & echo started")
    for _ in range(5):
        assert "sleep 30" not in client.fncall("ps -o args").stdout


def _pool(client: corral.Client, image: str, memory_mb: int = 256) -> corral.PoolStats:
    return next(p for p in client.fncall_pools() if p.image == image and p.memory_mb == memory_mb and not p.network)


def _settled(client: corral.Client, image: str, memory_mb: int = 256) -> corral.PoolStats:
    """The pool once every call has handed its sandbox back (that happens just after the answer)."""
    deadline = time.monotonic() + 10
    while _pool(client, image, memory_mb).in_use and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    return _pool(client, image, memory_mb)


def test_sysv_ipc_objects_are_not_seen_by_the_next_call(client: corral.Client) -> None:
    """Only the sandbox's own IPC namespace holds them (the host's /proc/sysvipc does not show them). Every warm
    sandbox serves a call first: a sandbox recycled before has its agent count them at the call's exit (no query)."""
    client.fncall("true", image="debian-12")
    for _ in range(_settled(client, "debian-12").warm):  # the pool hands out its longest-idle sandbox first
        client.fncall("true", image="debian-12")
    made = client.fncall("(ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1) >/dev/null && ipcs | grep -c 0x", image="debian-12")
    assert made.stdout.strip() == "3", made.stderr
    replaced = _settled(client, "debian-12").replaced
    for _ in range(6):  # whichever pooled sandbox serves it
        assert client.fncall("ipcs | grep -c 0x; true", image="debian-12").stdout.strip() == "0"
    assert _settled(client, "debian-12").replaced == replaced  # the sandbox that held them was not reused


def test_a_call_that_wrote_is_replaced_and_the_pool_recovers(client: corral.Client) -> None:
    client.fncall("true")
    before = _settled(client, "busybox")
    for i in range(4):
        assert client.fncall(f"echo {i} > /tmp/mine; cat /tmp/mine").stdout == f"{i}\n"
    after = _settled(client, "busybox")
    assert after.replaced >= before.replaced + 4  # a sandbox with a written file never serves again
    deadline = time.monotonic() + 10
    while (after := _pool(client, "busybox")).warm < after.target and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after.warm >= after.target  # ... and the pool refilled
    assert client.fncall("ls /tmp").stdout == ""


def test_hostile_calls_leave_the_pool_healthy(client: corral.Client) -> None:
    oom = client.fncall("tail /dev/zero", memory_mb=32, timeout_s=30)
    assert oom.oom_killed and oom.exit_code == -9
    loop = client.fncall("while true; do :; done", timeout_s=0.5)
    assert loop.timed_out
    bomb = client.fncall("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=2)
    assert bomb.timed_out or bomb.exit_code is not None
    assert client.fncall("echo fine").stdout == "fine\n"
    assert client.fncall("echo fine", memory_mb=32).stdout == "fine\n"


def test_pure_calls_reuse_warm_sandboxes(client: corral.Client) -> None:
    for _ in range(10):
        client.fncall("echo reuse-me")
    pool = _settled(client, "busybox")
    assert pool.recycled >= 5 and pool.hits >= 5
    assert pool.warm >= 1 and pool.hits + pool.misses >= 10


def test_no_network_unless_asked(client: corral.Client) -> None:
    assert client.fncall("ip -o link | wc -l").stdout.strip() == "1"


def test_batch(client: corral.Client) -> None:
    calls = [{"cmd": f"echo {i}"} for i in range(20)] + [{"cmd": "x", "code": "y"}]
    results = client.fncall_batch(calls)
    assert [r.stdout for r in results[:20] if isinstance(r, corral.FnCallResult)] == [f"{i}\n" for i in range(20)]
    assert isinstance(results[20], corral.InvalidRequest)


def test_run_code_with_tests(client: corral.Client) -> None:
    code = "import sys\nn = int(sys.stdin.read())\nprint(n * n)"
    report = client.run_code(
        code, tests=[{"stdin": "3", "expected_stdout": "9"}, {"stdin": "4", "expected_stdout": "15"}]
    )
    assert (report.passed, report.total) == (1, 2)
    assert [t.passed for t in report.tests] == [True, False]
    bash = client.run_code("read x; echo $((x + 1))", language="bash", tests=[{"stdin": "41", "expected_stdout": "42"}])
    assert bash.passed == 1
    with pytest.raises(corral.NotFound, match="no-such-image"):  # a call's own error, not a 500
        client.run_code("print(1)", image="no-such-image", tests=[{"stdin": ""}])


def test_pool_sandboxes_are_hidden_from_listings(client: corral.Client) -> None:
    client.fncall("true")
    assert all("corral.fncall" not in s.labels for s in client.list())
    assert client.list(labels={"corral.fncall": "1"})


def test_malformed_calls_are_refused_with_the_field_named(server: EmbeddedServer) -> None:
    """The route parses its body itself (the hot path): the errors are still the API's 400s."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    bad_limit = httpx.post(f"{server.url}/v1/fncall", json={"cmd": "true", "timeout_s": 0}, headers=headers)
    assert bad_limit.status_code == 400 and "timeout_s" in bad_limit.json()["error"]["message"]
    not_json = httpx.post(f"{server.url}/v1/fncall", content=b"{not json", headers=headers)
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_request"
    no_key = httpx.post(f"{server.url}/v1/fncall", json={"cmd": "true"})
    assert no_key.status_code == 401


async def test_a_burst_waits_for_returned_sandboxes_instead_of_overgrowing_the_pool(
    aclient: corral.AsyncClient, client: corral.Client
) -> None:
    """Concurrent calls into a new pool: calls that find no warm sandbox wait for one given back or started;
    the pool grows to the concurrency plus its warm minimum (2), not to its cap (32)."""
    import asyncio

    concurrency, rounds, memory_mb = 12, 6, 96  # a pool of its own

    async def one(i: int) -> str:
        return (await aclient.fncall(f"echo {i}", memory_mb=memory_mb)).stdout

    for _ in range(rounds):
        outputs = await asyncio.gather(*(one(i) for i in range(concurrency)))
        assert outputs == [f"{i}\n" for i in range(concurrency)]
    pool = _settled(client, "busybox", memory_mb)
    assert pool.hits + pool.misses == concurrency * rounds
    assert pool.misses <= concurrency + 2  # only while the pool was growing
    assert pool.warm <= concurrency + 2 and pool.replaced == 0
