"""The main job (`make demo`) runs end to end and says what it measured."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_demo_runs_container_episodes_and_a_microvm(test_env: dict[str, str]) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **test_env}
    run = subprocess.run([sys.executable, "-m", "corral.demo", "--sandboxes", "2"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "2 agent episodes on debian-12" in run.stdout
    assert "the process came along" in run.stdout and "0 job=demo sandboxes still running" in run.stdout
