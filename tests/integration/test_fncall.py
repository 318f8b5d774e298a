"""The fncall backend: short calls from pre-warmed pools, each as isolated as a fresh sandbox."""

from __future__ import annotations

import time

import corral


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
    time.sleep(0.3)
    pool = next(p for p in client.fncall_pools() if p.image == "busybox" and p.memory_mb == 256 and not p.network)
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


def test_pool_sandboxes_are_hidden_from_listings(client: corral.Client) -> None:
    client.fncall("true")
    assert all("corral.fncall" not in s.labels for s in client.list())
    assert client.list(labels={"corral.fncall": "1"})
