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


def test_tracing_off_never_imports_opentelemetry() -> None:
    """CORRAL_OTEL_TRACES off (the default) loads none of the otel extra (SDK, exporter, protobuf classes): a span
    is the shared no-op. The OpenTelemetry API itself is FastAPI's own dependency (its native telemetry, which
    stays off while no global tracer provider is set: Corral's provider is its own), so FastAPI imports that."""
    probe = (
        "import json, sys, corral.server, corral.cli.main, corral.cluster.edge_actor, corral.cluster.ray_edge\n"
        "from corral import tracing\n"
        "tracing.configure(False)\n"
        "with tracing.span('corral.sandbox.create', backend='container') as span:\n"
        "    span.set('sandbox_id', 'sb-e0-1')\n"
        "print(json.dumps([m for m in sys.modules if m.startswith('opentelemetry')]))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    modules = json.loads(loaded.stdout)
    assert "opentelemetry.trace" in modules, "the probe sees FastAPI's import of the API"
    extra = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
    assert [name for name in modules if name.startswith(extra)] == []
