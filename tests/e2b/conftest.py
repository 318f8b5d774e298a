"""The real ``e2b`` SDK pointed at the test server: E2B_API_URL and E2B_SANDBOX_URL are its URL.

The environment is set for the session (the SDK reads it when a sandbox or
client is made) and restored at the end; every sandbox a test creates is
killed by the fixture even when the test fails. A run that names the SDK it
means to test (``CORRAL_E2B_SDK_VERSION``, set by test_e2b_2_45.py) fails
unless that is the SDK it imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from corral.embedded import EmbeddedServer
from corral.gateway.e2b import e2b_api_key
from tests.e2b.sdk import E2B_VERSION

SDK_VERSION_ENV = "CORRAL_E2B_SDK_VERSION"


@pytest.fixture(scope="session", autouse=True)
def e2b_sdk_version() -> str:
    expected = os.environ.get(SDK_VERSION_ENV)
    assert expected in (None, str(E2B_VERSION)), f"{SDK_VERSION_ENV}={expected}, but e2b {E2B_VERSION} was imported"
    return str(E2B_VERSION)


@pytest.fixture(scope="session")
def e2b_env(server: EmbeddedServer) -> Iterator[dict[str, str]]:
    values = {"E2B_API_URL": server.url, "E2B_SANDBOX_URL": server.url, "E2B_API_KEY": e2b_api_key(server.api_key)}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def e2b_sandboxes(e2b_env: dict[str, str]) -> Iterator[list]:  # type: ignore[type-arg]
    """Append sandboxes here; each is killed after the test."""
    created: list = []  # type: ignore[type-arg]
    yield created
    for sandbox in created:
        try:
            sandbox.kill()
        except Exception:  # noqa: BLE001 - best effort: the server's teardown kills what is left
            pass
