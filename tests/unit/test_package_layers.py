"""Which packages the server may load: test doubles never reach the running server (issue 17)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_the_server_never_loads_the_test_doubles() -> None:
    probe = (
        "import json, sys, corral.server, corral.cli.main, corral.cluster.edge_actor\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('corral.'))))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    modules = json.loads(loaded.stdout)
    assert "corral.gateway.service" in modules and "corral.edge.local" in modules
    assert not [name for name in modules if name.startswith("corral.testing")]
