"""Which packages the server may load: test doubles never reach the running server (issue 17), and tracing off
loads none of the otel extra (issue 21). One probe process imports what `corral serve`, the CLI and a Ray edge
actor import, opens a span with tracing off, and lists the modules it then has."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

_PROBE = (
    "import json, sys, corral.server, corral.cli.main, corral.cluster.edge_actor, corral.cluster.ray_edge\n"
    "from corral import tracing\n"
    "tracing.configure(False)\n"
    "with tracing.span('corral.sandbox.create', backend='container') as span:\n"
    "    span.set('sandbox_id', 'sb-e0-1')\n"
    "print(json.dumps(sorted(sys.modules)))\n"
)


@pytest.fixture(scope="module")
def loaded() -> list[str]:
    probe = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    modules: list[str] = json.loads(probe.stdout)
    return modules


def test_the_server_never_loads_the_test_doubles(loaded: list[str]) -> None:
    assert "corral.gateway.service" in loaded and "corral.edge.local" in loaded
    assert not [name for name in loaded if name.startswith("corral.testing")]


def test_tracing_off_never_imports_opentelemetry(loaded: list[str]) -> None:
    """CORRAL_OTEL_TRACES off (the default) loads none of the otel extra (SDK, exporter, protobuf classes): a span
    is the shared no-op. The OpenTelemetry API itself is FastAPI's own dependency (its native telemetry, which
    stays off while no global tracer provider is set: Corral's provider is its own), so FastAPI imports that."""
    assert "opentelemetry.trace" in loaded, "the probe sees FastAPI's import of the API"
    extra = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
    assert [name for name in loaded if name.startswith(extra)] == []
