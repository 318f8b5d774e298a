"""The worked example: a trainer of corral.rl envs killed midway reconnects by job token and runs no command twice."""

from __future__ import annotations

import re
import subprocess
import sys

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import REPO


def test_preempted_trainer_fast_forwards_without_rerunning(client: corral.Client, server: EmbeddedServer) -> None:
    job, episodes, steps = "rollout-example", 3, 5
    token = client.issue_job_token(job)
    env = {**server.env(), "CORRAL_URL": server.url, "CORRAL_API_KEY": token}
    command = [sys.executable, "examples/rollout.py", "--job", job, "--episodes", str(episodes), "--steps", str(steps)]

    crashed = subprocess.run([*command, "--crash-after", "7"], env=env, cwd=REPO, capture_output=True, text=True)
    assert crashed.returncode == -9, crashed.stderr  # killed midway, like a preempted GPU job
    resumed = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    ran, replayed = map(int, re.findall(r"\d+", resumed.stdout)[:2])
    assert ran + replayed == episodes * steps and replayed >= 7 - episodes  # only unfinished steps ran

    assert resumed.stdout.splitlines()[1:] == [f"episode {k} reward 1.0" for k in range(episodes)]  # each log
    # holds every step exactly once, in order (the reward command compares it)
    sandboxes = client.list(state=["creating", "running", "paused", "ended", "lost"], labels={"job": job})
    assert len(sandboxes) == episodes  # reconnected to the same sandboxes, created none twice
    assert {info.state.value for info in sandboxes} == {"ended"}  # each env closed its episode's sandbox
