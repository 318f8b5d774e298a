"""The README's SDK example runs as written against a real server."""

from __future__ import annotations

import re
import subprocess
import sys

from corral.embedded import EmbeddedServer
from tests.conftest import REPO


def test_readme_python_examples(server: EmbeddedServer) -> None:
    """Every python block of the README, in order, as one script."""
    readme = (REPO / "README.md").read_text()
    script = "\n".join(re.findall(r"```python\n(.*?)```", readme, re.S))
    env = {**server.env(), "CORRAL_URL": server.url, "CORRAL_API_KEY": server.api_key}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "0 2"
    assert "exit None" in lines and lines[-6:-2] == ["42", "", "42", "1"]
    assert lines[-2] == "0" and lines[-1].startswith("microvm on ")  # the forked VM kept the running process
