"""e2b 2.30.0, from before the /v2 create and connect endpoints (POST /sandboxes, /sandboxes/{id}/connect).

scripts/setup.sh installs it with ``pip --target`` into .venv/e2b-2.30.0, apart
from the venv's current e2b; the session runs in a subprocess with that
directory first on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OLD_VERSION = "2.30.0"
OLD_SDK_DIR = Path(sys.prefix) / f"e2b-{OLD_VERSION}"


def test_old_sdk_session(e2b_env: dict[str, str]) -> None:
    assert (OLD_SDK_DIR / ".installed").exists(), f"{OLD_SDK_DIR} is missing: run scripts/setup.sh"
    script = Path(__file__).with_name("old_sdk_session.py")
    env = {**os.environ, **e2b_env, "PYTHONPATH": str(OLD_SDK_DIR)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["version"].startswith(str(OLD_SDK_DIR))
    assert report["stdout"] == "hi bar\nuser\n" and report["read"] == "old sdk" and report["stdin"] == "PIPED\n"
    assert report["id"] in report["listed"]
    assert report["paused"] == "paused" and report["after_connect"] == "back\n" and report["state"] == "running"
    assert report["killed"] is True
