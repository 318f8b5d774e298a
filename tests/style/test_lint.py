"""The code stays formatted and lint-clean (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

TREES = ["corral", "tests", "scripts", "examples"]


def test_ruff_check() -> None:
    run = subprocess.run([sys.executable, "-m", "ruff", "check", *TREES], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


def test_ruff_format() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *TREES], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout
