"""Drives CorralEnvironment through Harbor's own EnvironmentFactory and prints what it saw as one JSON line.

Run by tests/integration/test_harbor.py with the Python of Harbor's venv (Harbor needs 3.12+):
``python harbor_driver.py TASK_DIR WORK_DIR``, with CORRAL_URL and CORRAL_API_KEY set.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths

import corral


def _tree(root: Path) -> dict[str, str]:
    """Each entry under ``root``: a file's text (or its mode, if executable), a symlink's target."""
    seen = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            seen[name] = "->" + os.readlink(path)
        elif path.is_file():
            mode = path.stat().st_mode & 0o777
            seen[name] = f"mode {mode:o}" if mode & 0o100 else path.read_text()
    return seen


async def main(task_dir: Path, work: Path) -> dict[str, Any]:
    task = Task(task_dir)
    trial_paths = TrialPaths(work / "trial")
    trial_paths.mkdir()
    allowlist = NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["example.invalid", "192.0.2.0/24"])
    env = EnvironmentFactory.create_environment_from_import_path(
        "corral.integrations.harbor:CorralEnvironment",
        environment_dir=task.paths.environment_dir, environment_name=task.name, session_id="contract__env",
        trial_paths=trial_paths, task_env_config=task.config.environment,
        network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), phase_network_policies=[allowlist],
    )  # fmt: skip
    seen: dict[str, Any] = {}
    compose_only = work / "compose-env"
    compose_only.mkdir()
    (compose_only / "docker-compose.yaml").write_text("services: {main: {image: debian}}\n")
    try:
        EnvironmentFactory.create_environment_from_import_path(
            "corral.integrations.harbor:CorralEnvironment", environment_dir=compose_only,
            environment_name="compose", session_id="compose__env", trial_paths=trial_paths,
            task_env_config=task.config.environment.model_copy(),
        )  # fmt: skip
    except ValueError as exc:
        seen["compose"] = str(exc)
    await env.start(force_build=False)
    try:
        seen["sandbox_id"] = env.sandbox.id
        result = await env.exec(
            'echo "$(pwd) $(id -un) $X $((1 + 2))"; echo to-stderr >&2; exit 3',
            cwd="/tmp", env={"X": "hello-env"}, user="nobody",
        )  # fmt: skip
        seen["exec"] = result.model_dump()
        seen["default_cwd"] = (await env.exec("pwd")).stdout
        try:
            await env.exec("sleep 30", timeout_sec=1)
        except RuntimeError as exc:
            seen["timeout"] = f"{type(exc).__name__}: {exc}"
        chunks: list[tuple[str, str]] = []

        async def collect(text: str, stream: str) -> None:
            chunks.append((stream, text))

        with env.scoped_output_callback(collect):
            await env.exec("echo one; sleep 0.3; echo two")
        seen["streamed"] = {"text": "".join(text for _, text in chunks), "streams": sorted({s for s, _ in chunks})}

        script = work / "run-me.sh"
        script.write_text("#!/bin/sh\necho run-me\n")
        script.chmod(0o755)
        await env.upload_file(script, "/opt/tools/run-me.sh")
        seen["uploaded_file"] = {
            "text": (await env.exec("cat /opt/tools/run-me.sh")).stdout,
            "mode": (await env.exec("stat -c %a /opt/tools/run-me.sh")).stdout.strip(),
            "ran": (await env.exec("/opt/tools/run-me.sh")).stdout,
        }

        source = work / "in"
        (source / "sub" / "deep").mkdir(parents=True)
        (source / "a.txt").write_text("alpha")
        (source / "sub" / "deep" / "b.txt").write_text("beta")
        (source / "sub" / "link").symlink_to("deep/b.txt")
        (source / "run.sh").write_text("#!/bin/sh\n")
        (source / "run.sh").chmod(0o755)
        await env.upload_dir(source, "/data/in")
        await env.download_dir("/data/in", work / "out")
        seen["round_trip"] = _tree(work / "out")
        await env.download_file("/data/in/sub/deep/b.txt", work / "fetched" / "b.txt")
        seen["downloaded_file"] = (work / "fetched" / "b.txt").read_text()
        seen["kinds"] = {"dir": await env.is_dir("/data/in"), "file": await env.is_file("/data/in/a.txt"),
                         "missing": await env.is_file("/data/nothing")}  # fmt: skip

        network = [(await env.sandbox.network()).allow]
        await env.set_network_policy(allowlist)
        network.append([rule.host or rule.cidr for rule in (await env.sandbox.network()).allow or []])
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.PUBLIC))
        public = (await env.sandbox.network()).allow or []
        network.append({rule.action: sorted(r.cidr for r in public if r.action == rule.action) for rule in public})
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
        network.append((await env.sandbox.network()).allow)
        seen["network"] = network
    finally:
        await env.stop(delete=True)
    with corral.Client() as client:
        seen["after_stop"] = client.get(seen["sandbox_id"]).info.state.value
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))))
