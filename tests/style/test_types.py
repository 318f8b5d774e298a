"""The package type-checks under ``mypy --strict`` (configured in pyproject.toml: strict, over corral/), with
no error: the protocols (Backend, Edge) are what the code relies on, and SDK users' type checkers see the SDK's
real types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

CACHE_DIR = Path("/var/tmp/corral-mypy-cache")  # outside the clone, so a new clone's run reuses it (~45 s cold)


def test_mypy_strict_finds_no_error() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(CACHE_DIR)], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0 and "Success: no issues found" in run.stdout, run.stdout[-8000:] + run.stderr[-2000:]
