"""Several servers on one shared state: the layer store (layers fetched once, verified) and the node watcher."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.backends.common.host import runtime_state_root
from corral.embedded import EmbeddedServer, free_port
from corral.images.fetch import LayerFetcher
from corral.images.store import LayerStore
from corral.sdk import InternalError, NotFound, ServerUnavailable


def _busybox_digest(client: corral.Client) -> str:
    return client.images.inspect("busybox").layers[-1].digest


async def test_a_missing_layer_is_fetched_once_and_verified(server: EmbeddedServer, tmp_path: Path) -> None:
    with server.client() as client:
        digest = _busybox_digest(client)
    store = LayerStore(tmp_path / "node-layers")
    fetcher = LayerFetcher(store, server.url, server.api_key)
    paths = await asyncio.gather(*(fetcher.ensure(digest) for _ in range(4)))  # four sandboxes want it at once
    assert len(set(paths)) == 1 and fetcher.downloads == 1
    assert "sha256:" + hashlib.sha256(paths[0].read_bytes()).hexdigest() == digest
    assert store.layer(digest).kind == "base"
    assert await fetcher.ensure(digest) == paths[0] and fetcher.downloads == 1  # once per node
    with pytest.raises(NotFound, match="neither on this node nor in the layer store"):
        await fetcher.ensure("sha256:" + "0" * 64)
    with server.client() as client:
        job_key = client.issue_job_token("fetch-test")
    with pytest.raises(ServerUnavailable, match="403"):  # a job token cannot read layers (hidden grading layers)
        await LayerFetcher(LayerStore(tmp_path / "other"), server.url, job_key).ensure(digest)


@pytest.fixture
def lying_store() -> Iterator[str]:
    """A layer store on loopback that answers every blob request with bytes that do not match the digest."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = b"not the layer you asked for" * 100
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join()


async def test_a_layer_that_does_not_hash_to_its_digest_is_refused(lying_store: str, tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "node-layers")
    digest = "sha256:" + "ab" * 32
    with pytest.raises(InternalError, match="refused"):
        await LayerFetcher(store, lying_store, "key").ensure(digest)
    assert store.layers() == [] and not list(store.root.glob(".fetch-*"))  # nothing kept, no leftovers


def test_a_second_node_runs_sandboxes_from_layers_it_fetches(
    server: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str]
) -> None:
    """Two servers share PostgreSQL; the second has an empty layer store and fetches from the first."""
    shared = {**test_env, "CORRAL_DATABASE_URL": postgres_url}
    with EmbeddedServer(tmp_path / "a", env=shared) as first:
        with first.client() as client:
            digest = _busybox_digest(client)
        second_env = {**shared, "CORRAL_NODE_DIR": str(tmp_path / "node-b"), "CORRAL_EDGE_ID": "e1",
                      "CORRAL_LAYER_SOURCE_URL": first.url, "CORRAL_LAYER_SOURCE_KEY": first.api_key}  # fmt: skip
        with EmbeddedServer(tmp_path / "b", env=second_env) as second, second.client() as client:
            with client.create("busybox", ttl_s=120) as sandbox:
                assert sandbox.info.edge_id == "e1"
                assert sandbox.exec("echo from node b").stdout == "from node b\n"
            fetched = tmp_path / "node-b" / "layers" / "layers" / f"{digest.split(':')[1]}.erofs"
            assert fetched.exists()


def test_a_node_that_goes_silent_is_marked_lost_with_its_sandboxes(
    postgres_url: str, tmp_path: Path, test_env: dict[str, str]
) -> None:
    """The watcher: a second server is killed without a word; the first marks its node and sandboxes lost
    (and leaves the TTL of another node's sandbox to that node's own server)."""
    shared = {**test_env, "CORRAL_DATABASE_URL": postgres_url, "CORRAL_NODE_LOST_AFTER_S": "6"}
    with EmbeddedServer(tmp_path / "a", env=shared) as first:
        second = EmbeddedServer(tmp_path / "b", env={**shared, "CORRAL_EDGE_ID": "e2"})
        second.start()
        try:
            with second.client() as client:
                sandbox = client.create("busybox", ttl_s=3)  # expires before the node counts as lost
            assert second.process is not None
            second.process.kill()  # SIGKILL: no goodbye, its containers keep running
            second.process.wait()
            with first.client() as client:
                deadline = time.monotonic() + 30
                while client.get(sandbox.id).info.state != "lost" and time.monotonic() < deadline:
                    time.sleep(0.5)
                info = client.get(sandbox.id).info
                # Lost, not ttl_expired: the first server does not reap another node's sandboxes.
                assert (info.state, info.end_reason) == ("lost", "lost"), info
                assert "node e2 went silent" in (info.status_message or "")
                states = {node.edge_id: node.state for node in client.cluster_nodes()}
                assert (states["e0"], states["e2"]) == ("up", "lost")  # other tests' nodes may share this database
                with pytest.raises(corral.SandboxGone):
                    client.connect(sandbox).exec("true")  # requests to it get a clear error
        finally:
            second.start()  # back up: it finds its containers unowned (lost) and removes them
            second.shutdown()


def test_a_node_back_after_it_was_marked_lost_ends_its_lost_sandboxes(
    postgres_url: str, tmp_path: Path, test_env: dict[str, str]
) -> None:
    """A server frozen past the silence limit (a partition, a stalled machine) wakes up still running sandboxes
    the cluster marked lost: at its first heartbeat back it ends them, so none runs unaccounted for."""
    shared = {**test_env, "CORRAL_DATABASE_URL": postgres_url, "CORRAL_NODE_LOST_AFTER_S": "3"}
    with EmbeddedServer(tmp_path / "a", env=shared) as first:
        second = EmbeddedServer(tmp_path / "b", env={**shared, "CORRAL_EDGE_ID": "e9"})
        second.start()
        assert second.process is not None
        crun_list = ["crun", "--root", str(runtime_state_root(tmp_path / "b", "crun")), "list", "--quiet"]
        try:
            with second.client() as client:
                sandbox = client.create("busybox", ttl_s=600)
            assert sandbox.id in subprocess.run(crun_list, capture_output=True, text=True).stdout
            os.kill(second.process.pid, signal.SIGSTOP)
            with first.client() as client:
                deadline = time.monotonic() + 30
                while client.get(sandbox.id).info.state != "lost":
                    assert time.monotonic() < deadline, "the frozen node was not marked lost"
                    time.sleep(0.5)
                os.kill(second.process.pid, signal.SIGCONT)
                deadline = time.monotonic() + 30
                while sandbox.id in subprocess.run(crun_list, capture_output=True, text=True).stdout:
                    assert time.monotonic() < deadline, "the node kept running a sandbox marked lost"
                    time.sleep(0.5)
                assert {node.edge_id: node.state for node in client.cluster_nodes()}["e9"] == "up"
                assert client.get(sandbox.id).info.state == "lost"
        finally:
            os.kill(second.process.pid, signal.SIGCONT)
            second.shutdown()
