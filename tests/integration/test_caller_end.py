"""A throwaway server ends with the process that started it (Settings.stop_with_pid), however that process ends.

A test run or benchmark killed by SIGKILL (a CI timeout) or by SIGPIPE (`corral bench ... | head`) runs no
cleanup: its servers, with their sandboxes and warm pools, would run on until someone found them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from corral.backends.common.host import is_child_subreaper
from corral.embedded import delete_leftover_sandboxes
from corral.testing.leftovers import find_leftovers

# The caller: a server with a warm pool, two sandboxes it keeps, one pool sandbox warm; then it waits to be killed.
CALLER = """
import json, subprocess, sys, time
from pathlib import Path
from corral.backends.common.host import runtime_state_root
from corral.embedded import EmbeddedServer
pools = {"CORRAL_WARM_POOL_MEMORY_MB": "256", "CORRAL_WARM_POOL_WINDOW_S": "600"}
server = EmbeddedServer(Path(sys.argv[1]), env=pools)
server.start()
crun = ["crun", "--root", str(runtime_state_root(server.data_dir, "crun")), "list", "--quiet"]
with server.client() as client:
    kept = [client.create("busybox", memory_mb=40, ttl_s=600) for _ in range(2)]
    client.create("busybox", memory_mb=40, ttl_s=600).kill()
    warm = set()
    for _ in range(300):
        listed = {s.id for s in client.list()}
        warm = set(subprocess.run(crun, capture_output=True, text=True).stdout.split()) - listed
        if warm:
            break
        time.sleep(0.1)
print(json.dumps({"server_pid": server.process.pid, "ids": [s.id for s in kept], "warm": sorted(warm)}), flush=True)
time.sleep(600)
"""


def test_a_server_whose_caller_is_killed_kills_its_sandboxes_and_stops(
    tmp_path: Path, test_env: dict[str, str]
) -> None:
    # The killed caller's server goes to the nearest subreaper: were it this process, it would stay a zombie here.
    assert not is_child_subreaper(), "an earlier test left this test process a child subreaper"
    data_dir = tmp_path / "server"
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(data_dir)], env={**os.environ, **test_env}, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    server_pid = None
    try:
        assert caller.stdout is not None
        started = json.loads(caller.stdout.readline())
        server_pid, ids = started["server_pid"], set(started["ids"]) | set(started["warm"])
        assert started["warm"], "no pool sandbox was warm"
        assert find_leftovers(data_dir, ids).processes, "the sandboxes do not run"
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=30)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (data_dir / "server.log").read_text(errors="replace")
        assert not Path(f"/proc/{server_pid}").exists(), f"the server outlived its caller; its log ends:\n{log[-3000:]}"
        assert f"the process that started this server (pid {caller.pid}) ended" in log
        killed = re.search(r"killed (\d+) sandboxes; stopping", log)
        assert killed and int(killed[1]) >= 3, log[-2000:]  # the two kept and the pool's (one or more by then)
        # The server's mount namespace goes after its last process: the pool's btrfs unmount and its loop device's
        # autoclear follow asynchronously (a run found the loop device still attached right after the pid went).
        deadline = time.monotonic() + 10
        while (left := find_leftovers(data_dir, ids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, left
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        if server_pid is not None and Path(f"/proc/{server_pid}").exists():
            os.kill(server_pid, signal.SIGKILL)
        delete_leftover_sandboxes(data_dir)
