"""make test's two workers keep a file's tests together (``--dist loadgroup``, groups set in tests/conftest.py),
so a module's servers start once and the Ray cluster package brings up one cluster, not one per worker.

pytest 9.2 broke this without a word (pytest-xdist#1386: xdist's group suffix on the node id no longer takes
effect, and the tests are dealt out one by one); the pin in pyproject.toml keeps a pytest where it works, and
this test fails when an upgrade breaks it again."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

SAMPLE = "tests/unit/test_sandbox_record.py"  # a quick file with several tests


def test_a_files_tests_run_on_one_worker_under_its_group() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", SAMPLE],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    passed = re.findall(r"^\[(gw\d+)\] .*PASSED (\S+)", run.stdout, re.MULTILINE)
    assert run.returncode == 0 and len(passed) >= 3, run.stdout[-4000:] + run.stderr[-2000:]
    assert all(nodeid.endswith(f"@{SAMPLE}") for _, nodeid in passed), passed  # the group is on every test
    assert len({worker for worker, _ in passed}) == 1, passed  # and they all ran on one worker
