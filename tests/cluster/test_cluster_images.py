"""Registry images on the package's real Ray cluster (tests/cluster/conftest.py: three raylets with edge actors
over real crun, one gateway, PostgreSQL, in a network namespace of the test's own), a node that joins in the
middle of a burst, and a node's layer cache under its budget.

The registry is Debian's docker-registry on the host's 127.0.0.1, with images this module builds and pushes
with skopeo (corral/bench/registry.py). The cluster's namespace has a loopback of its own and no route out,
so the cluster forwards the registry's port into it (``LocalCluster(forward_ports=...)``,
cluster/network.py): the gateway reaches the same ``127.0.0.1:<port>/ns/img:tag`` the host pushed to, and
nothing leaves either loopback. Bytes are counted on the registry side, from its access log, and on each
node, from its on-demand layer marks.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import corral
from corral.bench.registry import Blob, Registry, image_blobs, layer_tar, push, tree_members
from corral.bench.registry import write_layout as oci_layout
from corral.cluster.local import LocalCluster
from corral.images.bases import build_busybox_rootfs
from corral.images.store import CHUNK_INDEX_BYTES
from tests.cluster.conftest import (
    FRESH_NODE_CACHE_BUDGET_MB,
    FRESH_NODE_LABELS,
    FRESH_NODE_SETTINGS,
    edge_of,
    join_fresh_node,
)

APP_CONFIG = {"Env": ["PATH=/usr/bin:/bin", "GREETING=from the registry"], "WorkingDir": "/srv/app",
              "User": "user", "Cmd": ["sh", "-c", "cat /srv/app/motd"]}  # fmt: skip
DATA_FILES, DATA_FILE_BYTES = 8, 2 << 20  # the "big" image's data layer: 16 MiB of random files
COLD_ROUNDS = 3  # images measured cold on the new node vs warm on an old one


@dataclass
class Pushed:
    registry: Registry
    blobs: dict[str, list[Blob]]  # repository -> [manifest, config, *layers]
    data_sha256: dict[str, str]  # /data/<name> of ns/big -> sha256

    def ref(self, repository: str) -> str:
        return f"{self.registry.address}/{repository}:v1"


def _busybox_layer(tmp: Path, marker: str) -> bytes:
    tree = tmp / f"busybox-{marker}"
    build_busybox_rootfs(tree)
    (tree / "etc/image-base").write_text(marker + "\n")  # a layer of its own per image
    return layer_tar(tree_members(tree))


def _push(tmp: Path, registry: Registry, repository: str, layers: list[bytes], config: dict[str, object]) -> list[Blob]:
    blobs = image_blobs(layers, config)
    push(oci_layout(tmp / repository.replace("/", "-"), "v1", blobs), "v1", registry, repository)
    return blobs


@pytest.fixture(scope="module")
def pushed(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Pushed:
    tmp = tmp_path_factory.mktemp("cluster-images")
    blobs: dict[str, list[Blob]] = {}
    for name in ("ns/app", "ns/burst-app"):  # no layer in common: each pull downloads all of its own
        app_files = layer_tar({"srv": None, "srv/app": None, "srv/app/motd": b"hello from a pulled layer\n",
                               "srv/app/name": name.encode()})  # fmt: skip
        blobs[name] = _push(tmp, registry, name, [_busybox_layer(tmp, name), app_files], APP_CONFIG)
    data = {f"f{i}": os.urandom(DATA_FILE_BYTES) for i in range(DATA_FILES)}
    data_layer = layer_tar({"data": None, **{f"data/{name}": content for name, content in data.items()}})
    blobs["ns/big"] = _push(tmp, registry, "ns/big", [_busybox_layer(tmp, "big"), data_layer], {})
    for round_ in range(COLD_ROUNDS):
        cold = [_busybox_layer(tmp, f"cold{round_}"), layer_tar({"etc": None, "etc/round": f"{round_}\n".encode()})]
        blobs[f"ns/cold{round_}"] = _push(tmp, registry, f"ns/cold{round_}", cold, {})
    return Pushed(registry, blobs, {name: hashlib.sha256(content).hexdigest() for name, content in data.items()})


def _manifest_gets(registry: Registry, repository: str, since: int) -> int:
    return sum(1 for entry in registry.access_log()[since:]
               if entry["method"] == "GET" and entry["path"].startswith(f"/v2/{repository}/manifests/"))  # fmt: skip


def _pulled_once(pushed: Pushed, repository: str, since: int) -> None:
    """Since access log entry ``since``: one manifest GET for ``repository``, and its config and layers once."""
    assert _manifest_gets(pushed.registry, repository, since) == 1
    expected_bytes = sum(len(blob.data) for blob in pushed.blobs[repository][1:])
    assert pushed.registry.blob_bytes_sent(repository, since=since) == expected_bytes


def _config_applied_on_every_node(created: list[corral.Sandbox]) -> None:
    """Sandboxes on all three nodes, each started with the image's env, working dir and user; killed after."""
    try:
        assert {edge_of(sb) for sb in created} == {"e1", "e2", "e3"}
        for sandbox in created:
            result = sandbox.exec('pwd; echo "$GREETING"; id -un; cat motd')
            lines = result.stdout.splitlines()
            assert lines == ["/srv/app", "from the registry", "user", "hello from a pulled layer"], result
            assert sandbox.info.cwd == "/srv/app" and sandbox.info.user == "user"
    finally:
        for sandbox in created:
            sandbox.kill()


def test_pull_through_a_cluster_gateway_then_create_on_the_nodes(pushed: Pushed, client: corral.Client) -> None:
    ref = pushed.ref("ns/app")
    since = len(pushed.registry.access_log())
    done = client.images.pull(ref)
    assert done.image is not None and done.image.name == ref and (done.layers_pulled, done.layers_reused) == (2, 0)
    _pulled_once(pushed, "ns/app", since)
    config = client.images.inspect(ref).config
    assert config is not None and config.cmd == ["sh", "-c", "cat /srv/app/motd"] and config.user == "user"
    _config_applied_on_every_node(list(client.create_many(6, ref, ttl_s=600)))


def test_concurrent_creates_across_nodes_pull_once(pushed: Pushed, client: corral.Client) -> None:
    """Twelve creates of a reference the gateway has never pulled, each its own request, all at once."""
    repository = "ns/burst-app"
    since = len(pushed.registry.access_log())
    with ThreadPoolExecutor(12) as pool:
        created = list(pool.map(lambda _: client.create(pushed.ref(repository), ttl_s=600), range(12)))
    try:
        _pulled_once(pushed, repository, since)  # one pull, which the other creates awaited
    finally:
        _config_applied_on_every_node(created)


def _present_bytes(cluster: LocalCluster, edge_id: str, digest: str) -> int:
    """Bytes of the layer this node has fetched so far (its verified on-demand chunks; all of it if complete)."""
    state = cluster.state
    assert state is not None
    layers = Path(state.nodes[edge_id].data_dir) / "node" / "layers"
    marks = layers / "partial" / f"{digest[7:]}.present"
    if marks.exists():
        return marks.read_bytes().count(1) * CHUNK_INDEX_BYTES
    complete = layers / "layers" / f"{digest[7:]}.erofs"
    return complete.stat().st_size if complete.exists() else 0


def test_a_node_that_joins_mid_burst_starts_sandboxes_from_layers_it_never_saw(
    pushed: Pushed, cluster: LocalCluster, client: corral.Client
) -> None:
    ref = pushed.ref("ns/big")
    client.images.pull(ref)
    data_layer = client.images.inspect(ref).layers[-1]
    burst_edges: list[str] = []  # where each create of the burst landed, in order
    failures: list[BaseException] = []
    stop = threading.Event()

    def create_until_stopped() -> None:  # churn: create, run a command, kill; until the test says stop
        while not stop.is_set():
            try:
                with client.create(ref, ttl_s=600) as sandbox:
                    assert sandbox.exec("cat /etc/image-base").stdout == "big\n"
                    burst_edges.append(edge_of(sandbox))
            except (corral.CorralError, AssertionError) as exc:  # reported below, never swallowed
                failures.append(exc)
                return

    workers = [threading.Thread(target=create_until_stopped) for _ in range(3)]
    for worker in workers:
        worker.start()
    on_new: list[corral.Sandbox] = []
    try:
        while len(burst_edges) < 3 and not failures:
            time.sleep(0.1)
        before_join = len(burst_edges)
        state = cluster.state
        assert state is not None and "e6" not in state.nodes  # a machine that has never seen the image
        cluster.add_node("e6", labels=FRESH_NODE_LABELS, settings=FRESH_NODE_SETTINGS)  # while the burst runs
        assert len(burst_edges) > before_join and not failures, "no create finished while the node joined"
        for _ in range(2):
            sandbox = client.create(ref, ttl_s=600, node_selector={"zone": "new"})
            on_new.append(sandbox)
            assert edge_of(sandbox) == "e6"
            assert sandbox.exec("sha256sum /data/f3").stdout.split()[0] == pushed.data_sha256["f3"]
        assert all(worker.is_alive() for worker in workers) and not failures, "the burst stopped"
        fetched = _present_bytes(cluster, "e6", data_layer.digest)
        # One file of eight read: on demand, not the whole layer (eager would have fetched all of it).
        assert DATA_FILE_BYTES <= fetched < data_layer.size_bytes / 2, (fetched, data_layer.size_bytes)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=300)
        for sandbox in on_new:
            sandbox.kill()
    assert not failures, failures
    print(f"burst: {len(burst_edges)} creates, {burst_edges.count('e6')} of them on e6 after it joined")


def test_cold_create_on_a_fresh_node_vs_a_node_with_the_layers(
    pushed: Pushed, cluster: LocalCluster, client: corral.Client
) -> None:
    """Create → first exec of an image the node never saw (e6 above) against one whose layers it has (e1 ran it
    just before), same run; medians of COLD_ROUNDS images. Printed (docs/cluster.md), not asserted on time."""
    join_fresh_node(cluster)  # unless the join test before did
    cold_ms: list[float] = []
    warm_ms: list[float] = []
    for round_ in range(COLD_ROUNDS):
        ref = pushed.ref(f"ns/cold{round_}")
        client.images.pull(ref)
        with client.create(ref, ttl_s=600, node_selector={"zone": "a"}) as first:  # its node gets the layers
            warm_node = edge_of(first)
        for edge, selector, times in ((warm_node, {"zone": "a"}, warm_ms), ("e6", {"zone": "new"}, cold_ms)):
            started = time.perf_counter()
            sandbox = client.create(ref, ttl_s=600, node_selector=selector)
            try:
                while edge != "e6" and edge_of(sandbox) != edge:  # the warm one must land where the layers are
                    sandbox.kill()
                    started = time.perf_counter()
                    sandbox = client.create(ref, ttl_s=600, node_selector=selector)
                assert sandbox.exec("cat /etc/round").stdout == f"{round_}\n"
                times.append((time.perf_counter() - started) * 1e3)
            finally:
                sandbox.kill()
    cold, warm = statistics.median(cold_ms), statistics.median(warm_ms)
    print(f"create -> first exec: fresh node {cold:.0f} ms, node with the layers {warm:.0f} ms, "
          f"ratio {cold / warm:.2f} (medians of {COLD_ROUNDS}; cold {cold_ms}, warm {warm_ms})")  # fmt: skip


def _scrape_node_cache_bytes(cluster: LocalCluster, edge_id: str) -> float:
    state = cluster.state
    assert state is not None
    text = httpx.get(f"{state.gateway_url}/metrics", headers={"Authorization": f"Bearer {state.api_key}"},
                     timeout=60).text  # fmt: skip
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "corral_node_layer_cache_bytes" and sample.labels.get("edge_id") == edge_id:
                return sample.value
    raise AssertionError(f"/metrics has no corral_node_layer_cache_bytes for {edge_id}")


def test_a_ray_node_keeps_its_layer_cache_under_its_budget(
    pushed: Pushed, cluster: LocalCluster, client: corral.Client
) -> None:
    """The edge actor evicts as the embedded server does: a partial layer nothing runs on goes when a create
    brings new layers past CORRAL_LAYER_CACHE_BUDGET_MB; one a running sandbox reads stays; /metrics shows it.
    On the fresh node (e6, which the tests above may have used: its budget evicted what they left)."""
    budget_mb = FRESH_NODE_CACHE_BUDGET_MB
    join_fresh_node(cluster)
    big, app = pushed.ref("ns/big"), pushed.ref("ns/app")
    for ref in (big, app):
        client.images.pull(ref)
    data_layer = client.images.inspect(big).layers[-1].digest
    state = cluster.state
    assert state is not None
    partial = Path(state.nodes["e6"].data_dir) / "node" / "layers" / "partial" / f"{data_layer[7:]}.data"
    with client.create(big, ttl_s=600, node_selector=FRESH_NODE_LABELS) as sandbox:
        assert sandbox.exec("cat /data/f0 /data/f1 /data/f2 /data/f3 > /dev/null").exit_code == 0
        assert _present_bytes(cluster, "e6", data_layer) >= 4 * DATA_FILE_BYTES  # 8 MiB: over the budget
        assert partial.exists()
        assert _scrape_node_cache_bytes(cluster, "e6") >= 4 * DATA_FILE_BYTES
    pid = cluster.edge_pid("e6")
    assert pid is not None
    deadline = time.monotonic() + 30
    mountinfo = Path(f"/proc/{pid}/mountinfo")
    while any(" - erofs " in line and data_layer[7:] in line for line in mountinfo.read_text().splitlines()):
        assert time.monotonic() < deadline, "the data layer stayed mounted after its sandbox ended (idle unmount)"
        time.sleep(0.2)
    with client.create(app, ttl_s=600, node_selector=FRESH_NODE_LABELS) as sandbox:  # new layers: a check
        assert sandbox.exec("cat /srv/app/motd").stdout == "hello from a pulled layer\n"
        assert not partial.exists(), "the unused partial layer stayed past the budget"
        assert _scrape_node_cache_bytes(cluster, "e6") <= budget_mb << 20
        with client.create(big, ttl_s=600, node_selector=FRESH_NODE_LABELS) as again:  # fetched anew, correct
            assert again.exec("sha256sum /data/f3").stdout.split()[0] == pushed.data_sha256["f3"]
