"""Pulling images from OCI registries, end to end against real registries on loopback.

Two docker-registry processes (one anonymous, one with bcrypt htpasswd auth; corral/bench/registry.py) get
images this module builds itself (tarfile → OCI layout → skopeo copy). A Corral server of the module's own
pulls from them (both listed in CORRAL_INSECURE_REGISTRIES, the auth one's credentials in an auth.json), and
sandboxes run from what it pulled. Bytes are counted on the registry side, from its access log. The
client-level tests run the registry client and the puller in this process against the same registries (and
a small front server for bearer tokens, redirects, broken connections and injected failures:
tests/oci_registry.py). A third registry serves https only, with a certificate of a CA the test makes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import corral
from corral.bench.registry import (
    Blob,
    Registry,
    ServerCertificate,
    htpasswd_file,
    image_blobs,
    layer_tar,
    push,
    start_registry,
    tree_members,
    write_index_layout,
    write_layout,
)
from corral.config import Settings
from corral.embedded import EmbeddedServer, linked_node_dir
from corral.images.bases import build_busybox_rootfs
from corral.images.builders import LayerBuilder
from corral.images.catalogue import Catalogue
from corral.images.pull import ImagePuller
from corral.images.registry import RegistryClient, RegistryConfig, parse_reference
from corral.images.store import LayerStore
from corral.server import registry_config
from corral.state.db import StateStore
from tests.conftest import REPO
from tests.oci_registry import Fault, RegistryFront, make_ca, server_certificate

pytestmark = pytest.mark.skipif(shutil.which("docker-registry") is None or shutil.which("skopeo") is None,
                                reason="needs docker-registry and skopeo (apt)")  # fmt: skip

USER, PASSWORD = "puller", "s3cret-pw"
APP_CONFIG = {"Env": ["PATH=/usr/bin:/bin", "FOO=bar baz", "APP_MODE=test"], "WorkingDir": "/opt/app",
              "Cmd": ["sh"], "Labels": {"org.example.name": "app"}}  # fmt: skip


@dataclass
class Images:
    anon: Registry
    auth: Registry
    app: list[Blob]  # [manifest, config, 5 layers]
    app2: list[Blob]  # shares app's first 3 layers, 2 of its own
    busybox_layer: bytes

    def ref(self, repository: str, tag: str = "v1", *, auth: bool = False) -> str:
        return f"{(self.auth if auth else self.anon).address}/{repository}:{tag}"


def _busybox_layer(tmp: Path, marker: str) -> bytes:
    tree = tmp / f"busybox-{marker}"
    build_busybox_rootfs(tree)
    (tree / "etc/image-base").write_text(marker + "\n")  # a layer of its own per image family
    return layer_tar(tree_members(tree))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    tmp = tmp_path_factory.mktemp("registries")
    anon = start_registry(tmp / "anon")
    auth = None
    try:
        auth = start_registry(tmp / "auth", htpasswd=htpasswd_file(tmp / "htpasswd", USER, PASSWORD))
        base = _busybox_layer(tmp, "plain")
        app_layers = [
            _busybox_layer(tmp, "app"),
            layer_tar(
                {
                    "etc": None,
                    "etc/gone": b"deleted above\n",
                    "data": None,
                    "data/old": None,
                    "data/old/one": b"1\n",
                    "data/old/two": b"2\n",
                    "opt": None,
                    "opt/app": None,
                }
            ),  # fmt: skip
            # whiteout of a file and an opaque dir (with one new file) in an upper layer
            layer_tar(
                {
                    "etc": None,
                    "etc/.wh.gone": b"",
                    "data": None,
                    "data/old": None,
                    "data/old/.wh..wh..opq": b"",
                    "data/old/new": b"new\n",
                }
            ),  # fmt: skip
            layer_tar({"opt": None, "opt/app": None, "opt/app/four": b"4" * 20_000}),
            layer_tar({"opt": None, "opt/app": None, "opt/app/five": b"5" * 30_000}),
        ]
        app = image_blobs(app_layers, APP_CONFIG)
        app2_layers = [*app_layers[:3], layer_tar({"srv": None, "srv/six": b"6" * 10_000}),
                       layer_tar({"srv": None, "srv/seven": b"7" * 12_000})]  # fmt: skip
        app2 = image_blobs(app2_layers, {"Env": ["PATH=/usr/bin:/bin", "WHO=app2"], "WorkingDir": "/srv",
                                         "User": "user"})  # fmt: skip
        plain = [base, layer_tar({"etc": None, "etc/flavour": b"burst\n"})]
        for name, blobs in (("ns/app", app), ("ns/app2", app2), ("ns/burst", image_blobs(plain, {})),
                            ("ns/corrupt", image_blobs([base, layer_tar({"x": b"x" * 5000})], {}))):  # fmt: skip
            push(write_layout(tmp / name.replace("/", "-"), "v1", blobs), "v1", anon, name)
        push(tmp / "ns-app", "v1", anon, "ns/docker-app", docker_format=True)  # the same image, Docker v2 schema 2
        platforms = [(image_blobs([base, layer_tar({"platform": f"{arch}\n".encode()})], {}, arch), arch)
                     for arch in ("arm64", "amd64", "ppc64le")]  # fmt: skip
        push(write_index_layout(tmp / "multi", "v1", platforms), "v1", anon, "ns/multi")
        private = image_blobs([base, layer_tar({"etc": None, "etc/private": b"yes\n"})], {"Env": ["SECRET=1"]})
        push(write_layout(tmp / "private", "v1", private), "v1", auth, "ns/private", creds=f"{USER}:{PASSWORD}")
        yield Images(anon=anon, auth=auth, app=app, app2=app2, busybox_layer=base)
    finally:
        anon.stop()
        if auth is not None:
            auth.stop()


@pytest.fixture(scope="module")
def registry_server(
    images: Images, tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]
) -> Iterator[EmbeddedServer]:
    tmp = tmp_path_factory.mktemp("registry-server")
    auth_file = tmp / "auth.json"
    encoded = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    auth_file.write_text(json.dumps({"auths": {images.auth.address: {"auth": encoded}}}))
    env = {**test_env, "CORRAL_INSECURE_REGISTRIES": f"{images.anon.address}, {images.auth.address}",
           "CORRAL_REGISTRY_AUTH_FILE": str(auth_file)}  # fmt: skip
    with EmbeddedServer(tmp / "server", env=env) as server:
        yield server


@pytest.fixture
def rclient(registry_server: EmbeddedServer) -> Iterator[corral.Client]:
    with registry_server.client() as client:
        yield client


def _blob_bytes(blobs: list[Blob]) -> int:
    """What pulling these blobs moves: the config and layers (the manifest is not a blob GET)."""
    return sum(len(blob.data) for blob in blobs[1:])


# -- through the server ---------------------------------------------------


def test_pull_five_layers_transfers_compressed_size_once(images: Images, rclient: corral.Client) -> None:
    ref = images.ref("ns/app")
    events: list[corral.PullEvent] = []
    since = len(images.anon.access_log())
    done = rclient.images.pull(ref, on_progress=events.append)
    assert done.image is not None and done.image.name == ref
    assert (done.layers_pulled, done.layers_reused) == (5, 0)
    assert len(done.image.layers) == 5  # one EROFS layer per OCI layer
    assert images.anon.blob_bytes_sent("ns/app", since=since) == _blob_bytes(images.app)  # each blob once
    assert events[-1].bytes_done == events[-1].bytes_total == sum(len(b.data) for b in images.app[2:])
    manifest_digest = images.app[0].digest
    listed = {image.name: image for image in rclient.images.list()}
    assert listed[ref].source == ref and listed[ref].manifest_digest == manifest_digest
    detail = rclient.images.inspect(ref)
    assert detail.manifest_digest == manifest_digest and detail.config is not None
    assert detail.config.env["FOO"] == "bar baz" and detail.config.working_dir == "/opt/app"
    assert detail.config.labels == {"org.example.name": "app"} and detail.config.cmd == ["sh"]
    oci_digests = [layer.source["oci_digest"] for layer in detail.layers]
    assert oci_digests == [blob.digest for blob in images.app[2:]]


def test_sandbox_from_pulled_image_sees_config_and_whiteouts(images: Images, rclient: corral.Client) -> None:
    rclient.images.pull(images.ref("ns/app"))
    with rclient.create(images.ref("ns/app"), env={"APP_MODE": "override"}, ttl_s=300) as sandbox:
        script = 'pwd; echo "$FOO|$APP_MODE"; ls /etc/gone; ls /data/old; ls /opt/app; cat /etc/image-base'
        result = sandbox.exec(script)
        assert result.stdout.splitlines() == ["/opt/app", "bar baz|override", "new", "five", "four", "app"], result
        assert "No such file" in result.stderr  # /etc/gone was deleted by the upper layer's whiteout
        assert sandbox.info.cwd == "/opt/app" and sandbox.info.user == "root"
        assert sandbox.exec("pwd", cwd="/tmp").stdout.strip() == "/tmp"
    with rclient.create(images.ref("ns/app"), cwd="/etc", ttl_s=300) as sandbox:
        assert sandbox.exec("pwd").stdout.strip() == "/etc"


def test_second_image_sharing_three_layers_transfers_only_the_other_two(images: Images, rclient: corral.Client) -> None:
    first = rclient.images.pull(images.ref("ns/app"))
    since = len(images.anon.access_log())
    done = rclient.images.pull(images.ref("ns/app2"))
    assert (done.layers_pulled, done.layers_reused) == (2, 3)
    # the config and the 2 layers app2 does not share, nothing else
    assert images.anon.blob_bytes_sent("ns/app2", since=since) == _blob_bytes([*images.app2[:2], *images.app2[5:]])
    assert first.image is not None and done.image is not None
    assert done.image.layers[:3] == first.image.layers[:3]  # the same EROFS layers: one mount, one page cache
    with rclient.create(environment={"base": images.ref("ns/app2")}, ttl_s=300) as sandbox:
        result = sandbox.exec('pwd; echo "$WHO"; ls /srv; ls /data/old; id -u')
        assert result.stdout.split() == ["/srv", "app2", "seven", "six", "new", "1000"]  # User "user" is uid 1000
        assert sandbox.info.user == "user"


async def test_concurrent_creates_of_one_ref_do_one_pull(images: Images, registry_server: EmbeddedServer) -> None:
    ref = images.ref("ns/burst")
    since = len(images.anon.access_log())
    async with corral.AsyncClient(registry_server.url, registry_server.api_key) as client:
        sandboxes = await asyncio.gather(*(client.create(ref, ttl_s=300) for _ in range(6)))
        try:
            results = await asyncio.gather(*(sandbox.exec("cat /etc/flavour") for sandbox in sandboxes))
            assert [result.stdout for result in results] == ["burst\n"] * 6
        finally:
            await asyncio.gather(*(sandbox.kill() for sandbox in sandboxes))
    log = images.anon.access_log()[since:]
    assert [e["method"] for e in log if e["path"] == "/v2/ns/burst/manifests/v1"] == ["GET"]
    assert len([e for e in log if e["path"].startswith("/v2/ns/burst/blobs/")]) == 3  # config + 2 layers, once each


def test_a_pull_on_create_keeps_the_store_under_the_disk_budget(images: Images, tmp_path: Path,
                                                              test_env: dict[str, str]) -> None:  # fmt: skip
    """The eviction builds run runs after a pull a create starts too: an untagged, unused layer goes."""
    env = {**test_env, "CORRAL_NODE_DIR": str(linked_node_dir(tmp_path / "node")),  # evicts only its own links
           "CORRAL_LAYER_DISK_BUDGET_MB": "1", "CORRAL_INSECURE_REGISTRIES": images.anon.address}  # fmt: skip
    tree = tmp_path / "old"
    tree.mkdir()
    (tree / "f").write_text("old\n")
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        old = client.images.build("old", "dir", path=str(tree)).layers[0]
        client.images.untag("old")
        assert old in {layer.digest for layer in client.images.layers()}  # untagged: nothing evicts until a pull
        with client.create(images.ref("ns/burst"), ttl_s=300) as sandbox:
            assert sandbox.exec("cat /etc/flavour").stdout == "burst\n"
        remaining = {layer.digest for layer in client.images.layers()}
        assert old not in remaining
        assert not (tmp_path / "node" / "layers" / "layers" / f"{old[7:]}.erofs").exists()
        assert {layer.digest for layer in client.images.inspect(images.ref("ns/burst")).layers} <= remaining


def test_docker_v2_schema2_manifest_shares_the_oci_images_layers(images: Images, rclient: corral.Client) -> None:
    rclient.images.pull(images.ref("ns/app"))
    since = len(images.anon.access_log())
    done = rclient.images.pull(images.ref("ns/docker-app"))
    assert (done.layers_pulled, done.layers_reused) == (0, 5)  # the same layer blobs, so not one downloaded
    assert images.anon.blob_bytes_sent("ns/docker-app", since=since) == len(images.app[1].data)  # the config only
    assert done.image is not None and done.image.manifest_digest != images.app[0].digest  # another manifest
    assert done.image.layers == [layer.digest for layer in rclient.images.inspect(images.ref("ns/app")).layers]
    assert done.image.config is not None and done.image.config.working_dir == "/opt/app"


def test_cli_pull_ls_inspect(images: Images, registry_server: EmbeddedServer) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral.cli.main", *args], env=registry_server.env(),
                              cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip

    ref = images.ref("ns/burst", "v1")
    pulled = cli("images", "pull", ref)
    assert pulled.returncode == 0 and f"pulled {ref}: 2 layers" in pulled.stdout, pulled.stderr
    listed = cli("images", "ls")
    row = next(line for line in listed.stdout.splitlines() if ref in line)
    cells = [cell.strip() for cell in row.split("│") if cell.strip()]
    with registry_server.client() as client:
        manifest_digest = client.images.inspect(ref).manifest_digest
    assert manifest_digest is not None and cells[0] == ref and cells[-2:] == [ref, manifest_digest[:19]]
    inspected = cli("images", "inspect", ref)
    assert f"pulled from {ref}, manifest {manifest_digest}" in inspected.stdout
    removed = cli("images", "rm", ref)
    assert removed.returncode == 0 and f"untagged {ref}" in removed.stdout, removed.stderr
    since = len(images.anon.access_log())
    again = cli("images", "pull", ref)  # the layers are still here: only the manifest and config come again
    assert again.returncode == 0 and "(2 already here)" in again.stdout, again.stderr
    assert [e["path"].split("/")[-2] for e in images.anon.access_log()[since:]] == ["manifests", "blobs"]


def test_pull_by_digest(images: Images, rclient: corral.Client) -> None:
    pinned = f"{images.anon.address}/ns/app@{images.app[0].digest}"
    done = rclient.images.pull(pinned)
    assert done.image is not None and done.image.name == pinned and done.image.manifest_digest == images.app[0].digest
    assert rclient.images.inspect(pinned).source == pinned
    with pytest.raises(corral.NotFound):
        rclient.images.pull(f"{images.anon.address}/ns/app@sha256:{'0' * 64}")


def test_index_picks_linux_amd64(images: Images, rclient: corral.Client) -> None:
    with rclient.create(environment={"base": images.ref("ns/multi")}, ttl_s=300) as sandbox:
        assert sandbox.exec("cat /platform").stdout == "amd64\n"
    detail = rclient.images.inspect(images.ref("ns/multi"))
    assert detail.source == images.ref("ns/multi") and detail.manifest_digest is not None


def test_pull_with_basic_auth_from_the_auth_file(images: Images, rclient: corral.Client) -> None:
    done = rclient.images.pull(images.ref("ns/private", auth=True))
    assert done.image is not None and done.image.config is not None and done.image.config.env == {"SECRET": "1"}
    with rclient.create(images.ref("ns/private", auth=True), ttl_s=300) as sandbox:
        assert sandbox.exec("cat /etc/private; echo $SECRET").stdout == "yes\n1\n"


def test_digest_mismatch_is_refused_and_nothing_kept(images: Images, rclient: corral.Client) -> None:
    ref = images.ref("ns/corrupt")
    layout_layer = json.loads(_manifest_of(images.anon, "ns/corrupt"))["layers"][1]["digest"]
    stored = images.anon.storage_blob(layout_layer)
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same length, other bytes
    stored.write_bytes(bytes(data))
    with pytest.raises(corral.ServerUnavailable, match="corrupt"):
        rclient.images.pull(ref)
    with pytest.raises(corral.NotFound):
        rclient.images.inspect(ref)
    assert not any(layer.source.get("oci_digest") == layout_layer for layer in rclient.images.layers())


def test_dockerfile_from_a_pulled_image(images: Images, rclient: corral.Client, tmp_path: Path) -> None:
    """FROM a registry image not here yet pulls it and builds on it; a second build uses the pulled copy."""
    base = image_blobs(
        [
            images.busybox_layer,
            layer_tar({"opt": None, "opt/base": None, "opt/base/pulled.txt": b"from the registry\n"}),
        ],
        {"Env": ["PATH=/usr/bin:/bin", "GREETING=hello from the registry"], "WorkingDir": "/opt/base"},
    )
    push(write_layout(tmp_path / "layout", "v1", base), "v1", images.anon, "ns/dockerbase")
    ref = images.ref("ns/dockerbase")
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(f'FROM {ref}\nRUN echo "$GREETING" > built.txt; cat pulled.txt >> built.txt\n')
    since = len(images.anon.access_log())
    lines: list[str] = []
    built = rclient.images.build_dockerfile("df-on-pulled", context / "Dockerfile", on_progress=lines.append)
    assert [e["path"] for e in images.anon.access_log()[since:] if "/manifests/" in e["path"]] == [
        "/v2/ns/dockerbase/manifests/v1"]  # fmt: skip
    assert lines[0] == f"Step 1/2 : FROM {ref}" and any(f"{ref}: 2 layers" in line for line in lines), lines
    pulled = rclient.images.inspect(ref)
    assert pulled.source == ref and pulled.manifest_digest == base[0].digest
    assert built.layers[:2] == [layer.digest for layer in pulled.layers] and len(built.layers) == 3  # + the RUN's
    assert built.config.env["GREETING"] == "hello from the registry" and built.config.working_dir == "/opt/base"
    with rclient.create("df-on-pulled", ttl_s=300) as sandbox:
        result = sandbox.exec('pwd; echo "$GREETING"; cat pulled.txt built.txt')
        assert result.stdout.splitlines() == ["/opt/base", "hello from the registry", "from the registry",
                                              "hello from the registry", "from the registry"], result  # fmt: skip
    since = len(images.anon.access_log())
    again = rclient.images.build_dockerfile("df-on-pulled-again", context / "Dockerfile")
    assert again.layers == built.layers and images.anon.access_log()[since:] == []  # the pulled copy, cached RUN


def _manifest_of(registry: Registry, repository: str) -> str:
    import httpx

    response = httpx.get(f"{registry.url}/v2/{repository}/manifests/v1",
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})  # fmt: skip
    return response.text


# -- the client and puller in this process ---------------------------------


@contextlib.contextmanager
def _puller(root: Path, config: RegistryConfig) -> Iterator[ImagePuller]:
    """A puller in this process into a fresh store under ``root``."""
    store = StateStore(f"sqlite:///{root / 'state.db'}")
    catalogue = Catalogue(store.engine, LayerStore(root / "layers"))
    builder = LayerBuilder(catalogue, root / "build", 1 << 30)
    try:
        yield ImagePuller(catalogue, builder, config, max_layer_bytes=1 << 30)
    finally:
        store.close()


@pytest.fixture
def puller(tmp_path: Path, images: Images) -> Iterator[ImagePuller]:
    with _puller(tmp_path, RegistryConfig(insecure=frozenset({images.anon.address}))) as made:
        yield made


async def test_insecure_registry_refused_without_the_setting(images: Images) -> None:
    config = registry_config(Settings())
    assert config.insecure == frozenset()
    async with RegistryClient(config) as client:
        with pytest.raises(corral.ServerUnavailable, match="CORRAL_INSECURE_REGISTRIES"):
            await client.manifest(parse_reference(images.ref("ns/app")))
    listed = registry_config(Settings(insecure_registries=f"{images.anon.address},other:5000"))  # type: ignore[arg-type]
    assert listed.insecure == frozenset({images.anon.address, "other:5000"})


async def test_bad_or_missing_credentials_are_a_clear_error(images: Images) -> None:
    reference = parse_reference(images.ref("ns/private", auth=True))
    insecure = frozenset({images.auth.address})
    wrong = RegistryConfig(insecure=insecure, credentials={images.auth.address: (USER, "wrong")})
    async with RegistryClient(wrong) as client:
        with pytest.raises(corral.PermissionDenied, match=f"refused access to ns/private as '{USER}'"):
            await client.manifest(reference)
    async with RegistryClient(RegistryConfig(insecure=insecure)) as client:
        with pytest.raises(corral.PermissionDenied, match="asks for a user and password"):
            await client.manifest(reference)
    settings = Settings(insecure_registries=images.auth.address,  # type: ignore[arg-type]
                        registry_credentials={images.auth.address: f"{USER}:{PASSWORD}"})  # fmt: skip
    async with RegistryClient(registry_config(settings)) as client:
        manifest = await client.manifest(reference)
        assert len(manifest.layers) == 2


async def test_bearer_token_auth_and_refusal(images: Images) -> None:
    front = RegistryFront(images.anon, bearer=(USER, PASSWORD))
    try:
        reference = parse_reference(f"{front.address}/ns/burst:v1")
        good = RegistryConfig(insecure=frozenset({front.address}), credentials={front.address: (USER, PASSWORD)})
        async with RegistryClient(good) as client:
            manifest = await client.manifest(reference)
            config = await client.config(manifest)
            assert config["os"] == "linux" and front.token_requests == 1  # the token is reused
        bad = RegistryConfig(insecure=frozenset({front.address}), credentials={front.address: (USER, "nope")})
        async with RegistryClient(bad) as client:
            with pytest.raises(corral.PermissionDenied, match="token server .* refused as 'puller'"):
                await client.manifest(reference)
            assert front.attempts("/token") == [200, 401] and client.retries == 0  # a refusal is not retried
    finally:
        front.close()


async def test_blob_redirect_and_resume_after_a_broken_connection(images: Images, tmp_path: Path) -> None:
    front = RegistryFront(images.anon, redirect=True, cut_after_bytes=4096)
    try:
        reference = parse_reference(f"{front.address}/ns/app2:v1")
        async with RegistryClient(RegistryConfig(insecure=frozenset({front.address}))) as client:
            manifest = await client.manifest(reference)
            big = max(manifest.layers, key=lambda blob: blob.size_bytes)
            await client.download_blob(reference, big, tmp_path / "blob")
            assert (tmp_path / "blob").read_bytes() == next(b.data for b in images.app2 if b.digest == big.digest)
            assert front.ranges == [None, "bytes=4096-"]  # cut at 4096, resumed from there
    finally:
        front.close()


async def test_puller_reuses_layers_across_images_and_joins_concurrent_pulls(images: Images,
                                                                            puller: ImagePuller) -> None:  # fmt: skip
    first, again = await asyncio.gather(puller.pull(images.ref("ns/app")), puller.pull(images.ref("ns/app")))
    assert first is again and puller.pulls == 1
    second = await puller.pull(images.ref("ns/app2"))
    assert (second.layers_pulled, second.layers_reused) == (2, 3)
    assert second.bytes_transferred == len(images.app2[0].data) + _blob_bytes([images.app2[0], images.app2[1],
                                                                               *images.app2[5:]])  # fmt: skip


async def test_concurrent_pulls_of_images_sharing_layers_download_each_once(images: Images,
                                                                           puller: ImagePuller) -> None:  # fmt: skip
    since = len(images.anon.access_log())
    app, app2 = await asyncio.gather(puller.pull(images.ref("ns/app")), puller.pull(images.ref("ns/app2")))
    assert app.layers_pulled + app2.layers_pulled == 7  # 5 + 2: the 3 shared layers came once, in one of them
    assert app.image.layers[:3] == app2.image.layers[:3]
    layer_gets = [e["path"].rsplit("/", 1)[-1] for e in images.anon.access_log()[since:]
                  if e["method"] == "GET" and "/blobs/" in e["path"]]  # fmt: skip
    layers = {blob.digest for blob in [*images.app[2:], *images.app2[2:]]}
    assert sorted(d for d in layer_gets if d in layers) == sorted(layers)  # each layer blob GET once


# -- https, and retries -----------------------------------------------------


@dataclass
class TlsRegistry:
    registry: Registry
    certificate: ServerCertificate
    other_ca: Path  # a CA that did not sign the registry's certificate

    def ref(self) -> str:
        return f"{self.registry.address}/ns/tls:v1"


@pytest.fixture(scope="module")
def tls_registry(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRegistry]:
    """docker-registry serving https only, its certificate (127.0.0.1, localhost) signed by a CA made here."""
    tmp = tmp_path_factory.mktemp("tls")
    certificate = server_certificate(tmp / "ca", make_ca(tmp / "ca", "corral-test-ca"))
    other_ca, _ = make_ca(tmp / "other", "another-test-ca")
    registry = start_registry(tmp / "registry", tls=certificate)
    try:
        blobs = image_blobs([images.busybox_layer, layer_tar({"etc": None, "etc/tls": b"over https\n"})],
                            {"Env": ["PATH=/usr/bin:/bin", "CHANNEL=tls"]})  # fmt: skip
        push(write_layout(tmp / "layout", "v1", blobs), "v1", registry, "ns/tls")
        yield TlsRegistry(registry=registry, certificate=certificate, other_ca=other_ca)
    finally:
        registry.stop()


async def test_https_registry_is_refused_unless_its_ca_is_trusted(tls_registry: TlsRegistry, tmp_path: Path) -> None:
    reference = parse_reference(tls_registry.ref())
    since = len(tls_registry.registry.access_log())
    for ca_file in (None, tls_registry.other_ca):  # the system's store alone; another CA added to it
        async with RegistryClient(registry_config(Settings(registry_ca_file=ca_file))) as client:
            with pytest.raises(corral.ServerUnavailable) as refused:
                await client.manifest(reference)
            assert client.retries == 0  # asking again would not change the certificate
        address = tls_registry.registry.address
        assert refused.value.message.startswith(
            f"the https certificate of registry {address} is not trusted (unable to get local issuer certificate; "
        ) and "give that CA's certificate (PEM) in CORRAL_REGISTRY_CA_FILE" in refused.value.message  # fmt: skip
    assert tls_registry.registry.access_log()[since:] == []  # no request got past the handshake
    with pytest.raises(corral.InvalidRequest, match="does not exist \\(CORRAL_REGISTRY_CA_FILE\\)"):
        registry_config(Settings(registry_ca_file=tmp_path / "missing.pem"))

    trusted = registry_config(Settings(registry_ca_file=tls_registry.certificate.ca_certificate))
    with _puller(tmp_path, trusted) as puller:
        pulled = await puller.pull(tls_registry.ref())
    assert (pulled.layers_pulled, pulled.image.config.env["CHANNEL"]) == (2, "tls")
    answered = [(e["path"].split("/")[-2], e["status"]) for e in tls_registry.registry.access_log()[since:]]
    assert answered == [("manifests", "200")] + [("blobs", "200")] * 3  # config + 2 layers, over https

    # Listed as insecure, it is spoken to in plain HTTP only: refused, never downgraded to unverified https.
    listed = Settings(insecure_registries=tls_registry.registry.address,  # type: ignore[arg-type]
                      registry_ca_file=tls_registry.certificate.ca_certificate)  # fmt: skip
    async with RegistryClient(registry_config(listed)) as client:
        refusal = "speaks https .*but it is listed in CORRAL_INSECURE_REGISTRIES, whose registries are reached over"
        with pytest.raises(corral.ServerUnavailable, match=refusal + " plain HTTP only"):
            await client.manifest(reference)
        assert client.retries == 0


def test_server_pulls_over_https_with_the_ca_setting(tls_registry: TlsRegistry, rclient: corral.Client,
                                                     tmp_path: Path, test_env: dict[str, str]) -> None:  # fmt: skip
    with pytest.raises(corral.ServerUnavailable, match="certificate of registry .* is not trusted"):
        rclient.images.pull(tls_registry.ref())  # the module's server has no CORRAL_REGISTRY_CA_FILE
    env = {**test_env, "CORRAL_REGISTRY_CA_FILE": str(tls_registry.certificate.ca_certificate)}
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        with client.create(tls_registry.ref(), ttl_s=300) as sandbox:  # pulled on first use, over https
            assert sandbox.exec("cat /etc/tls; echo $CHANNEL").stdout == "over https\ntls\n"
        assert client.images.inspect(tls_registry.ref()).source == tls_registry.ref()


async def test_transient_failures_are_retried_on_every_request(images: Images) -> None:
    front = RegistryFront(images.anon, bearer=(USER, PASSWORD))
    try:
        front.inject("/manifests/", [Fault(None), Fault(502)])  # a connection closed unanswered, then a 502
        front.inject("/token", [Fault(503)])
        front.inject("/blobs/", [Fault(429, retry_after="1"), Fault(500)])
        config = RegistryConfig(insecure=frozenset({front.address}), credentials={front.address: (USER, PASSWORD)},
                                backoff_s=0.01)  # fmt: skip
        async with RegistryClient(config) as client:
            manifest = await client.manifest(parse_reference(f"{front.address}/ns/app:v1"))
            assert manifest.digest == images.app[0].digest
            # the manifest's 401 challenge sends for a token, whose first answer is a 503
            assert front.attempts("/manifests/") == [None, 502, 401, 200]
            assert front.attempts("/token") == [503, 200]
            image_config = await client.config(manifest)
            assert image_config["config"]["WorkingDir"] == "/opt/app"
            assert front.attempts("/blobs/") == [429, 500, 200]
            assert client.retries == 5
        blob_times = [at for at, path, _ in front.requests if "/blobs/" in path]
        assert blob_times[1] - blob_times[0] >= 0.95  # Retry-After: 1 was waited for, not the 10 ms backoff
    finally:
        front.close()


async def test_permanent_errors_surface_at_once_and_retries_are_bounded(images: Images) -> None:
    front = RegistryFront(images.anon)
    try:
        config = RegistryConfig(insecure=frozenset({front.address}), retries=2, backoff_s=0.01, max_delay_s=0.5)
        async with RegistryClient(config) as client:
            with pytest.raises(corral.NotFound, match="ns/app:nope is not in registry .* \\(404\\)"):
                await client.manifest(parse_reference(f"{front.address}/ns/app:nope"))
            front.inject("/manifests/", [Fault(403)])
            with pytest.raises(corral.PermissionDenied, match="refused manifest v1 of .*ns/app \\(403\\)"):
                await client.manifest(parse_reference(f"{front.address}/ns/app:v1"))
            front.inject("/manifests/", [Fault(400)])
            with pytest.raises(corral.ServerUnavailable, match="answered 400 for manifest v1"):
                await client.manifest(parse_reference(f"{front.address}/ns/app:v1"))
            assert front.attempts("/manifests/") == [404, 403, 400] and client.retries == 0

            front.inject("/manifests/", [Fault(503, retry_after="3600")] * 3)
            started = time.monotonic()
            with pytest.raises(corral.ServerUnavailable) as gave_up:
                await client.manifest(parse_reference(f"{front.address}/ns/app:v1"))
            waited_s = time.monotonic() - started
        assert gave_up.value.message == (
            f"registry {front.address} answered 503; gave up after 3 attempts to get manifest v1 of "
            f"{front.address}/ns/app"
        )
        assert front.attempts("/manifests/")[3:] == [503, 503, 503]
        assert 2 * 0.5 * 0.95 <= waited_s <= 2 * 0.5 + 5  # the hour of Retry-After capped at max_delay_s
    finally:
        front.close()
