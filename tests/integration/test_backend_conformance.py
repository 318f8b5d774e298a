"""Every backend passes the same checks (tests/backend_conformance.py) against the Backend protocol: container
with crun, gVisor (runsc), microvm, vm, and the simulated one; fncall's reuse of a sandbox is the ``recycle`` check.

Each kind runs once, in a process of its own (see tests/backend_conformance.py), and each of its checks is a test
here; a check skips only when the kind's declared capabilities exclude it. A VM kind boots once and restores
once (about 2-4 s each on TCG); the full VM (q35, its own init) is marked slow.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.backend_conformance import CHECKS

REPO = Path(__file__).resolve().parents[2]
_KIND_TIMEOUT_S = 420

pytestmark = pytest.mark.timeout(_KIND_TIMEOUT_S + 60)

KINDS = [
    "container/crun",
    pytest.param("container/runsc", marks=pytest.mark.skipif(shutil.which("runsc") is None, reason="no runsc")),
    "microvm",
    pytest.param("vm", marks=pytest.mark.slow),
    "simulated",
]


@pytest.fixture(scope="module")
def report(
    tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]
) -> Callable[[str], dict[str, dict[str, str]]]:
    """The checks' outcomes for a kind, by check name, from one run of that kind's process."""
    reports: dict[str, dict[str, dict[str, str]]] = {}

    def of(kind: str) -> dict[str, dict[str, str]]:
        if kind not in reports:
            data_dir = tmp_path_factory.mktemp("conformance")
            run = subprocess.run(
                [sys.executable, "-m", "tests.backend_conformance", kind, test_env["CORRAL_NODE_DIR"], str(data_dir)],
                cwd=REPO, capture_output=True, text=True, timeout=_KIND_TIMEOUT_S, check=False,
            )  # fmt: skip
            lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
            assert run.returncode == 0 and lines, f"{kind}: exit {run.returncode}\n{run.stderr[-4000:]}"
            reports[kind] = {line["check"]: line for line in lines}
        return reports[kind]

    return of


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("check", list(CHECKS))
def test_backend_conforms(report: Callable[[str], dict[str, dict[str, str]]], kind: str, check: str) -> None:
    outcome = report(kind)[check]
    if outcome["outcome"] == "skipped":
        pytest.skip(outcome["detail"])
    assert outcome["outcome"] == "passed", outcome["detail"]
