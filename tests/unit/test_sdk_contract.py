"""The SDK's shape: errors map one-to-one to statuses, sync mirrors async, exports are complete."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator

import pytest

import corral
import corral.api
from corral.api.errors import error_from_response
from tests.conftest import REPO

ERRORS = [
    corral.InvalidRequest,
    corral.AuthenticationError,
    corral.PermissionDenied,
    corral.NotFound,
    corral.Conflict,
    corral.SandboxGone,
    corral.PayloadTooLarge,
    corral.CapacityExhausted,
    corral.ServerUnavailable,
    corral.InternalError,
]


def test_every_error_has_its_own_status_and_code() -> None:
    assert len({e.status for e in ERRORS}) == len(ERRORS)
    assert len({e.code for e in ERRORS}) == len(ERRORS)
    assert all(issubclass(e, corral.CorralError) for e in ERRORS)


@pytest.mark.parametrize("error", ERRORS)
def test_error_round_trips_through_http(error: type[corral.CorralError]) -> None:
    original = error("what happened and what to do")
    rebuilt = error_from_response(original.status, original.to_body())
    assert type(rebuilt) is error and rebuilt.message == original.message


def test_unknown_body_falls_back_to_status() -> None:
    assert type(error_from_response(404, {"detail": "Not Found"})) is corral.NotFound
    assert type(error_from_response(418, None)) is corral.CorralError


def test_sync_client_is_generated_from_async() -> None:
    check = subprocess.run([sys.executable, "scripts/unasync.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_sync_and_async_have_the_same_methods() -> None:
    for sync_cls, async_cls in [(corral.Client, corral.AsyncClient), (corral.Sandbox, corral.AsyncSandbox),
                                (corral.Files, corral.AsyncFiles), (corral.Images, corral.AsyncImages)]:  # fmt: skip
        public = {n.replace("aclose", "close") for n in dir(async_cls) if not n.startswith("_")}
        assert public == {n for n in dir(sync_cls) if not n.startswith("_")}


def test_all_is_complete() -> None:
    for name in corral.__all__:
        assert hasattr(corral, name), name
    assert set(corral.api.__all__) <= set(corral.__all__)  # the SDK offers the whole wire contract
    for name in corral.api.__all__:
        assert hasattr(corral.api, name), name
    assert {"CorralError", "SandboxGone", "CreateSandboxRequest", "ExecResult"} <= set(corral.api.__all__)


def test_client_needs_a_key(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("CORRAL_API_KEY", raising=False)
    monkeypatch.setenv("CORRAL_CONFIG_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(corral.AuthenticationError, match="corral serve"):
        corral.Client("http://127.0.0.1:1")


def test_connection_precedence(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "client.json"
    config.write_text('{"url": "http://127.0.0.1:1111", "api_key": "ck_file"}')
    monkeypatch.setenv("CORRAL_CONFIG_FILE", str(config))
    monkeypatch.delenv("CORRAL_URL", raising=False)
    monkeypatch.delenv("CORRAL_API_KEY", raising=False)
    assert (corral.Client().url, corral.Client().api_key) == ("http://127.0.0.1:1111", "ck_file")
    monkeypatch.setenv("CORRAL_URL", "http://127.0.0.1:2222")
    monkeypatch.setenv("CORRAL_API_KEY", "ck_env")
    assert (corral.Client().url, corral.Client().api_key) == ("http://127.0.0.1:2222", "ck_env")
    explicit = corral.Client("http://127.0.0.1:3333", "ck_arg")
    assert (explicit.url, explicit.api_key) == ("http://127.0.0.1:3333", "ck_arg")


def test_invalid_arguments_fail_before_sending(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    client = corral.Client("http://127.0.0.1:1", "ck_x")  # nothing listens there: validation must come first
    with pytest.raises(corral.InvalidRequest, match="memory_mb"):
        client.create(memory_mb=-5)


def test_handle_pickles_without_its_connection() -> None:
    info = corral.SandboxInfo(
        id="sb-e0-0123456789abcdef", edge_id="e0", state=corral.SandboxState.RUNNING, image="busybox:latest",
        backend="container", runtime="crun", cpu=1, memory_mb=512, pids_max=256, user="root", cwd="/", labels={},
        created_at=0.0,
    )  # fmt: skip
    sandbox = corral.Sandbox(info, "http://127.0.0.1:9", "ck_x")
    clone = pickle.loads(pickle.dumps(sandbox))
    assert (clone.id, clone.url, clone.api_key, clone.info) == (sandbox.id, sandbox.url, sandbox.api_key, sandbox.info)


def test_generated_docs_are_current() -> None:
    check = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_every_reference_in_the_api_document_resolves() -> None:
    """Hot routes read their bodies themselves and name the schema by reference (routes/deps.py ``json_body``): the
    model must still be in the document through another route, or the reference dangles."""
    document = json.loads((REPO / "docs" / "openapi.json").read_text())

    def refs(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    yield value
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for item in node:
                yield from refs(item)

    found = set(refs(document))
    assert "#/components/schemas/ExecRequest" in found and "#/components/schemas/FnCallRequest" in found
    schemas = document["components"]["schemas"]
    assert [ref for ref in sorted(found) if ref.removeprefix("#/components/schemas/") not in schemas] == []
