"""mini-swe-agent's own agent loop on a Corral sandbox, driven by its DeterministicModel (issue 20)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import yaml

import corral
from corral.embedded import EmbeddedServer


@pytest.fixture
def minisweagent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The package, imported with its global config dir (which its import creates) kept out of the user's home."""
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea-config"))
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    return importlib.import_module("minisweagent")


def test_agent_runs_to_submission_on_corral(
    minisweagent: ModuleType, server: EmbeddedServer, client: corral.Client, tmp_path: Path
) -> None:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output

    config = yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "default.yaml").read_text())
    env = get_environment({"environment_class": "corral.integrations.mini_swe_agent.CorralEnvironment",
                           "url": server.url, "api_key": server.api_key, "cwd": "/root", "timeout": 3,
                           "env": {"GREETING": "hello"}, "labels": {"test": "mini-swe-agent"}})  # fmt: skip
    steps = [
        "mkdir -p /work && printf 'def f():\\n    return 1\\n' > /work/f.py && echo \"$GREETING from $(pwd)\"",
        "echo to-stderr >&2; echo to-stdout; exit 3",
        "echo started; sleep 60",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /work/f.py",
    ]
    model = DeterministicModel(outputs=[make_output(f"THOUGHT: step {i}", [{"command": c}], cost=0.0)
                                        for i, c in enumerate(steps)])  # fmt: skip
    agent = DefaultAgent(model, env, **{**config["agent"], "output_path": tmp_path / "traj.json"})

    info = agent.run("Write f.py and submit it.")

    assert info["exit_status"] == "Submitted" and info["submission"] == "def f():\n    return 1\n"
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]  # after the task prompt
    assert "<returncode>0</returncode>" in observations[0] and "hello from /root" in observations[0]
    assert "<returncode>3</returncode>" in observations[1] and "to-stderr\nto-stdout" in observations[1]
    assert "<returncode>-1</returncode>" in observations[2] and "timed out after 3 seconds" in observations[2]
    assert "started" in observations[2]  # the output before the timeout
    assert env.get_template_vars()["system"] == "Linux"  # the sandbox's uname fills the prompt's {{system}}
    sandbox_id = env.serialize()["info"]["corral_sandbox_id"]
    assert client.get(sandbox_id).exec("cat /work/f.py").stdout == info["submission"]  # it ran in that sandbox

    env.cleanup()
    assert client.get(sandbox_id).info.state.value == "ended"
    assert env.execute({"command": "true"})["returncode"] == -1  # after cleanup: an error result, not a crash
