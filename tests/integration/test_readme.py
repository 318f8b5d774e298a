"""The README's SDK example runs as written against a real server."""

from __future__ import annotations

import re
import subprocess
import sys

from corral.embedded import EmbeddedServer
from tests.conftest import REPO


def test_readme_python_example(server: EmbeddedServer) -> None:
    readme = (REPO / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S)
    assert example is not None
    env = {**server.env(), "CORRAL_URL": server.url, "CORRAL_API_KEY": server.api_key}
    run = subprocess.run([sys.executable, "-c", example.group(1)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "0 2"
    assert "exit None" in lines and lines[-2:] == ["42", ""]
