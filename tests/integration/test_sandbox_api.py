"""Sandbox lifecycle, errors and the HTTP surface, against a real server."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import time

import httpx
import pytest

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import REPO


def test_create_get_list_kill(client: corral.Client) -> None:
    sandbox = client.create("busybox", cpu=0.5, memory_mb=128, labels={"job": "j1", "episode": "7"}, ttl_s=600)
    info = sandbox.info
    assert info.state == corral.SandboxState.RUNNING
    assert (info.cpu, info.memory_mb, info.image, info.edge_id) == (0.5, 128, "busybox:latest", "e0")
    assert info.id.startswith("sb-e0-")
    assert client.get(sandbox.id).info.id == sandbox.id
    assert [s.id for s in client.list(labels={"job": "j1", "episode": "7"})] == [sandbox.id]
    assert client.list(labels={"job": "other"}) == []
    ended = sandbox.kill()
    assert ended.state == corral.SandboxState.ENDED and ended.end_reason == "killed"
    assert sandbox.id not in [s.id for s in client.list()]
    assert sandbox.id in [s.id for s in client.list(state=["ended"])]
    with pytest.raises(corral.SandboxGone, match="killed"):
        sandbox.exec("true")


def test_context_manager_kills_on_exit(client: corral.Client) -> None:
    with client.create("busybox") as sandbox:
        assert sandbox.exec("true").exit_code == 0
    assert client.get(sandbox.id).info.state == corral.SandboxState.ENDED


def test_handle_is_plain_data(client: corral.Client, server: EmbeddedServer) -> None:
    with client.create("busybox") as sandbox:
        clone = pickle.loads(pickle.dumps(sandbox))
        assert clone.id == sandbox.id and clone.url == server.url
        assert clone.exec("echo via-pickle").stdout == "via-pickle\n"
        clone.close()


def test_debian_image_has_python_and_git(client: corral.Client) -> None:
    with client.create("debian-12") as sandbox:
        result = sandbox.exec("python3 -c 'print(6*7)' && git --version && bash -c 'echo $BASH_VERSION'")
        assert result.exit_code == 0, result.stderr
        assert result.stdout.startswith("42\ngit version 2.")


def test_runc_is_selectable(client: corral.Client) -> None:
    with client.create("busybox", runtime="runc") as sandbox:
        assert sandbox.info.runtime == "runc"
        assert sandbox.exec("echo runc").stdout == "runc\n"
        sandbox.files.write("/x", "y")
        assert sandbox.files.read_text("/x") == "y"


def test_ttl_destroys_the_sandbox(client: corral.Client) -> None:
    sandbox = client.create("busybox", ttl_s=1)
    deadline = time.monotonic() + 10
    while client.get(sandbox.id).info.state != corral.SandboxState.ENDED:
        assert time.monotonic() < deadline, "TTL did not destroy the sandbox"
        time.sleep(0.1)
    assert client.get(sandbox.id).info.end_reason == "ttl_expired"


def test_set_ttl_extends_and_removes(client: corral.Client) -> None:
    sandbox = client.create("busybox", ttl_s=1)
    info = sandbox.set_ttl(None)
    assert info.expires_at is None
    time.sleep(1.5)
    assert sandbox.exec("true").exit_code == 0
    info = sandbox.set_ttl(30)
    assert info.expires_at is not None and info.expires_at > time.time() + 25
    sandbox.kill()


def test_create_from_explicit_layers(client: corral.Client) -> None:
    busybox = next(i for i in client.images.list() if i.name == "busybox:latest")
    with client.create(layers=busybox.layers) as sandbox:
        assert sandbox.info.image == busybox.layers[0].split(":")[1][:12]
        assert sandbox.exec("echo layered").stdout == "layered\n"
    with pytest.raises(corral.NotFound):
        client.create(layers=["sha256:" + "0" * 64])


def test_unknown_image(client: corral.Client) -> None:
    with pytest.raises(corral.NotFound, match="busybox"):  # the message lists what exists
        client.create("no-such-image")


@pytest.mark.parametrize(
    "kwargs",
    [{"cpu": 1000}, {"memory_mb": 10_000_000}, {"cpu": -1}, {"memory_mb": 0}, {"pids_max": 1}, {"cwd": "relative"}],
)
def test_impossible_limits(client: corral.Client, kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(corral.InvalidRequest):
        client.create("busybox", **kwargs)


def test_unknown_sandbox(client: corral.Client) -> None:
    with pytest.raises(corral.NotFound):
        client.get("sb-e0-0000000000000000")
    with pytest.raises(corral.NotFound, match="look like"):
        client.get("garbage")


def test_wrong_api_key(server: EmbeddedServer) -> None:
    with pytest.raises(corral.AuthenticationError):
        corral.Client(server.url, "ck_wrong").list()
    response = httpx.get(f"{server.url}/v1/sandboxes")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"


def test_every_route_that_declares_the_bearer_scheme_refuses_a_request_without_it(server: EmbeddedServer) -> None:
    """Routes check the key in different ways (a dependency, or the hot routes' own parsing after it): each one the
    document says needs the key answers 401 without it, whatever its path and body."""
    document = json.loads((REPO / "docs" / "openapi.json").read_text())
    checked = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if not operation.get("security"):
                continue
            url = path.replace("{sandbox_id}", "sb-e0-0000000000000000")
            url = re.sub(r"\{[a-z_]+\}", "x", url)
            response = httpx.request(method, f"{server.url}{url}", json={}, timeout=30)
            assert (response.status_code, response.json()["error"]["code"]) == (401, "unauthenticated"), (method, path)
            checked.append((method, path))
    assert ("post", "/v1/sandboxes/{sandbox_id}/exec") in checked and ("post", "/v1/fncall") in checked
    assert len(checked) >= 60


def test_unreachable_server() -> None:
    with pytest.raises(corral.ServerUnavailable, match="cannot reach"):
        corral.Client("http://127.0.0.1:1", "ck_x").list()


def test_openapi_document(server: EmbeddedServer) -> None:
    document = httpx.get(f"{server.url}/openapi.json").json()
    paths = document["paths"]
    for path in ["/v1/sandboxes", "/v1/sandboxes/{sandbox_id}/exec", "/v1/sandboxes/{sandbox_id}/files/content"]:
        assert path in paths
    assert "CreateSandboxRequest" in document["components"]["schemas"]
    assert document == json.loads((REPO / "docs" / "openapi.json").read_text())  # the repo's copy is what runs


def test_cli_against_running_server(server: EmbeddedServer) -> None:
    env = server.env()

    def corral_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "corral.cli.main", *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    created = corral_cli("create", "busybox", "--label", "from=cli")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    run = corral_cli("exec", sandbox_id, "echo hello; exit 4")
    assert (run.returncode, run.stdout) == (4, "hello\n")
    listed = corral_cli("ls", "--label", "from=cli")
    assert sandbox_id in listed.stdout
    assert "busybox" in corral_cli("images").stdout
    assert "base" in corral_cli("images", "ls", "--layers").stdout
    assert "busybox:latest: 1 layers" in corral_cli("images", "inspect", "busybox").stdout
    nodes = corral_cli("nodes")
    assert nodes.returncode == 0 and "e0" in nodes.stdout and "up" in nodes.stdout, nodes.stderr
    assert corral_cli("rm", sandbox_id).returncode == 0
    missing = corral_cli("exec", sandbox_id, "true")
    assert missing.returncode == 1 and "sandbox_gone" in missing.stderr


async def test_async_client_matches_sync(aclient: corral.AsyncClient) -> None:
    async with await aclient.create("busybox", labels={"api": "async"}) as sandbox:
        result = await sandbox.exec("echo async")
        assert result.stdout == "async\n"
        await sandbox.files.write("/f", b"data")
        assert await sandbox.files.read("/f") == b"data"
        assert [s.id for s in await aclient.list(labels={"api": "async"})] == [sandbox.id]
    assert (await aclient.get(sandbox.id)).info.state == corral.SandboxState.ENDED


def test_idle_connection_outlives_clients_keepalive(server: EmbeddedServer) -> None:
    """The server keeps an idle connection open longer than clients keep theirs (uvicorn's default of 5 s
    equalled httpx's: under the 100-create burst a kill sent as the server closed its idle connection
    was lost, httpx.ReadError). Proven on one socket: a second request after 6 s idle is answered on it."""
    import http.client
    from urllib.parse import urlsplit

    from corral.sdk._transport import IDLE_EXPIRY_S

    assert IDLE_EXPIRY_S < 620
    address = urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port, timeout=10)
    try:
        connection.request("GET", "/healthz")
        first = connection.getresponse()
        assert (first.status, json.loads(first.read())["status"]) == (200, "ok")
        socket_before = connection.sock
        time.sleep(6)
        connection.request("GET", "/healthz")
        second = connection.getresponse()
        assert (second.status, json.loads(second.read())["status"]) == (200, "ok")
        assert connection.sock is socket_before
    finally:
        connection.close()


async def test_hundred_concurrent_creates(aclient: corral.AsyncClient) -> None:
    import asyncio

    sandboxes = await asyncio.gather(
        *(aclient.create("busybox", memory_mb=64, labels={"burst": "1"}) for _ in range(100))
    )
    try:
        results = await asyncio.gather(*(sb.exec("echo ok") for sb in sandboxes))
        assert all(r.stdout == "ok\n" for r in results)
        assert len({sb.id for sb in sandboxes}) == 100
    finally:
        await asyncio.gather(*(sb.kill() for sb in sandboxes))
