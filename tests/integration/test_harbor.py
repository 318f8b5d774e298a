"""The released Harbor runs a task end to end on Corral, and its environment contract holds (issue 20).

Harbor needs Python 3.12 or later and Corral's venv is 3.11, so these tests run Harbor in a venv of its own,
made once with uv from a Python 3.12+ interpreter found on this machine (pyenv's, or python3.12 on PATH) and
kept in ``VENV_ROOT`` under a name with Harbor's version and the interpreter's (about 15 s and 320 MB the first
time; nothing after). Corral comes from this checkout on PYTHONPATH: Harbor needs pydantic 2.14 or later while
Corral pins 2.13.4 for its server, and the SDK that the integration uses runs on either. Without such an
interpreter the tests skip and say how to get one (docs/integrations.md).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import corral
from corral.backends.common.network import NON_PUBLIC_NETWORKS
from corral.embedded import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]
HARBOR_VERSION = "0.26.0"
VENV_ROOT = Path(os.environ.get("CORRAL_HARBOR_VENV_ROOT", "/var/tmp/corral-harbor-venv"))
IMPORT_PATH = "corral.integrations.harbor:CorralEnvironment"
DRIVER = Path(__file__).with_name("harbor_driver.py")
# What Corral's SDK needs that Harbor does not bring (docs/integrations.md): the sync client's HTTP parser, as pinned.
SDK_ONLY_NEEDS = next(r for r in importlib.metadata.requires("corral") or [] if r.startswith("httptools=="))
VENV_BUILD_TIMEOUT_S = 240  # each uv step; both took 15-30 s here, within the test's own 300 s


def _interpreters() -> list[str]:
    """Where a Python 3.12+ may be: CORRAL_HARBOR_PYTHON, PATH (pyenv's shims answer only for its selected
    versions, so each candidate is run, not trusted), then every version pyenv has installed."""
    named = [os.environ.get("CORRAL_HARBOR_PYTHON"), shutil.which("python3.13"), shutil.which("python3.12")]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    installed = sorted(pyenv.glob("3.1[2-9]*/bin/python3"), reverse=True) if pyenv.is_dir() else []
    return [str(path) for path in [*named, *installed] if path]


def _find_python() -> tuple[str, str] | None:
    """(the interpreter's real path, "3.12") of the first candidate that runs, is 3.12+, and has venv."""
    probe = "import sys, venv; print(sys.executable); print('%d.%d' % sys.version_info[:2])"
    for candidate in _interpreters():
        try:
            found = subprocess.run([candidate, "-c", probe], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = found.stdout.split()
        if found.returncode == 0 and len(lines) == 2 and tuple(map(int, lines[1].split("."))) >= (3, 12):
            return lines[0], lines[1]
    return None


@pytest.fixture(scope="module")
def harbor_venv() -> Path:
    """The venv with the released harbor (made on first use; a half-made one is made again)."""
    python = _find_python()
    if python is None:
        pytest.skip(
            "Harbor needs Python 3.12+ and none was found (CORRAL_HARBOR_PYTHON, python3.12/3.13 on PATH, "
            "~/.pyenv/versions): `pyenv install 3.12`, or set CORRAL_HARBOR_PYTHON to one (docs/integrations.md)"
        )
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        pytest.skip(f"uv is not installed next to {sys.executable}: run scripts/setup.sh (it is a dev dependency)")
    interpreter, version = python
    venv = VENV_ROOT / f"harbor-{HARBOR_VERSION}-py{version}"
    VENV_ROOT.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "UV_CACHE_DIR": str(VENV_ROOT / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never",
           "UV_NATIVE_TLS": "1"}  # fmt: skip
    with open(VENV_ROOT / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run making the same venv: wait for it
        complete = venv / ".complete"
        wanted = f"harbor=={HARBOR_VERSION} {SDK_ONLY_NEEDS} on {interpreter}\n"
        if not complete.exists() or complete.read_text() != wanted:
            shutil.rmtree(venv, ignore_errors=True)
            for step in (
                [str(uv), "venv", "--quiet", "--python", interpreter, str(venv)],
                [str(uv), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
                 f"harbor=={HARBOR_VERSION}", SDK_ONLY_NEEDS],
            ):  # fmt: skip
                subprocess.run(step, check=True, env=env, timeout=VENV_BUILD_TIMEOUT_S)
            complete.write_text(wanted)
    return venv


def _harbor_env(server: EmbeddedServer, tmp_path: Path) -> dict[str, str]:
    """What Harbor's process gets: the server, Corral from this checkout, and no traffic leaving the machine
    (Harbor's telemetry off, litellm's cost map read from its package instead of fetched)."""
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO),
            "CORRAL_URL": server.url, "CORRAL_API_KEY": server.api_key,
            "CORRAL_CONFIG_FILE": str(tmp_path / "no-client.json"), "HARBOR_TELEMETRY": "0",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # fmt: skip


def _write_task(root: Path) -> Path:
    """A Harbor task: a Dockerfile that Corral builds, an instruction, the oracle's solution, a verifier."""
    files = {
        "task.toml": "[agent]\ntimeout_sec = 60.0\n\n[verifier]\ntimeout_sec = 60.0\n\n[environment]\ncpus = 1\n"
        'memory_mb = 512\nenv = { GREETING = "hello from the task" }\n',  # network_mode: Harbor's default, public
        "instruction.md": "Write the reversed contents of /app/seed.txt to /app/answer.txt.\n",
        "environment/Dockerfile": "FROM debian-12\nWORKDIR /app\nRUN echo corral > /app/seed.txt\n",
        "solution/solve.sh": "#!/bin/bash\nset -euo pipefail\nrev seed.txt > answer.txt\n"
        'echo "solved in $(pwd) as $(id -un): $GREETING"\n',
        "tests/test.sh": '#!/bin/bash\nanswer=$(cat /app/answer.txt)\necho "answer: $answer"\n'
        '[ "$answer" = larroc ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n',
    }
    task = root / "reverse-seed"
    for name, text in files.items():
        path = task / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755 if name.endswith(".sh") else 0o644)
    return task


def test_harbor_run_oracle_on_corral(
    harbor_venv: Path, server: EmbeddedServer, client: corral.Client, tmp_path: Path
) -> None:
    task = _write_task(tmp_path)
    jobs = tmp_path / "jobs"
    run = subprocess.run(
        [str(harbor_venv / "bin" / "harbor"), "run", "--path", str(task), "--agent", "oracle", "--env", IMPORT_PATH,
         "--ek", "labels={\"suite\": \"corral-test\"}", "--jobs-dir", str(jobs), "--yes"],
        env=_harbor_env(server, tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (trial,) = [path.parent for path in jobs.glob("*/*/result.json")]
    result = json.loads((trial / "result.json").read_text())
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    # The oracle ran solve.sh in the Dockerfile's WORKDIR with the task's env; the verifier saw its answer.
    assert (trial / "agent" / "oracle.txt").read_text() == "solved in /app as root: hello from the task\n"
    assert (trial / "verifier" / "test-stdout.txt").read_text() == "answer: larroc\n"
    (made,) = client.list(state=["ended"], labels={"suite": "corral-test", "harbor.task": "reverse-seed"})
    assert made.state.value == "ended"  # killed at the trial's end
    assert made.image.startswith("harbor-reverse-seed:")  # built from the task's Dockerfile by the server
    assert (made.cpu, made.memory_mb, made.cwd) == (1.0, 512, "/app")  # the task's resources, the WORKDIR
    assert made.network is not None and made.network.allow[-2].cidr == "0.0.0.0/0"  # Harbor's default: public


def test_environment_contract(harbor_venv: Path, server: EmbeddedServer, client: corral.Client, tmp_path: Path) -> None:
    """exec's options, transfers both ways, network policy switches and stop, driven through Harbor's own
    EnvironmentFactory by harbor_driver.py (it imports Harbor, so it runs in Harbor's venv)."""
    task = _write_task(tmp_path)
    run = subprocess.run(
        [str(harbor_venv / "bin" / "python"), str(DRIVER), str(task), str(tmp_path / "driver")],
        env=_harbor_env(server, tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["exec"] == {"stdout": "/tmp nobody hello-env 3\n", "stderr": "to-stderr\n", "return_code": 3}
    assert seen["default_cwd"] == "/app\n"  # the Dockerfile's WORKDIR
    assert seen["timeout"] == "RuntimeError: Command timed out after 1 seconds"
    assert seen["streamed"] == {"text": "one\ntwo\n", "streams": ["stdout"]}  # to the phase's callback
    assert seen["uploaded_file"] == {"text": "#!/bin/sh\necho run-me\n", "mode": "755", "ran": "run-me\n"}
    assert seen["round_trip"] == {"a.txt": "alpha", "sub/deep/b.txt": "beta", "sub/link": "->deep/b.txt",
                                  "run.sh": "mode 755"}  # fmt: skip
    assert seen["downloaded_file"] == "beta"
    assert seen["kinds"] == {"dir": True, "file": True, "missing": False}
    public = {"deny": sorted(NON_PUBLIC_NETWORKS), "allow": ["0.0.0.0/0", "::/0"]}  # as the E2B facade's internet
    assert seen["network"] == [None, ["example.invalid", "192.0.2.0/24"], public, []]  # loopback first, closed last
    assert seen["after_stop"] == "ended"
    assert "not Docker Compose services" in seen["compose"]  # refused before any sandbox
    sandbox = client.get(seen["sandbox_id"])
    assert sandbox.info.labels["harbor.session"] == "contract__env" and sandbox.info.state.value == "ended"
