"""The typed sandbox record (corral/state/records.py): its fields are the table's columns, and its conversions keep
every setting a create gave it (to the spec its edge starts, to the request of a fork or replay, to what a client
reads), through a real SQLite store."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from corral.api.models import CreateSandboxRequest, NetworkPolicy, NetworkRule, SandboxState
from corral.backends.base import SETUID_LABEL, LayerRef
from corral.backends.common.network import AllowRule
from corral.state.db import StateStore, sandboxes
from corral.state.records import SandboxRecord
from corral.testing.records import sandbox_record

_REQUEST = CreateSandboxRequest(
    backend="container", runtime="runc", cpu=0.5, qos="batch", memory_mb=96, pids_max=64, env={"TASK": "t-3"},
    cwd="/work", user="1000:1000", labels={"job": "j-9", "episode": "4", SETUID_LABEL: "allowed"},
    node_selector={"zone": "b"}, ttl_s=90, ttl_counts_paused=True, idle_pause_s=30,
    network=NetworkPolicy(allow=[NetworkRule(cidr="10.88.200.0/24", ports=[443]), NetworkRule(host="pypi.org")]),
    disk_mb=256, protected_paths=["/work/tests/"], sensitive_paths=["/work/hidden/"],
)  # fmt: skip
_LAYERS = (LayerRef("sha256:" + "a" * 64, Path("/layers/a.erofs")), LayerRef("sha256:" + "b" * 64, Path("/b")))


def _record() -> SandboxRecord:
    keys = [layer.mount_key for layer in _LAYERS]
    return SandboxRecord.of_create(_REQUEST, sandbox_id="sb-e4-00000000000000f1", edge_id="e4", image="debian-12",
                                   runtime="runc", layers=keys, now=1000.0)  # fmt: skip


def test_the_record_has_the_tables_columns_in_their_order() -> None:
    """The store builds records from rows by position: a column added to one and not the other fails here."""
    columns = [column.name for column in sandboxes.columns]
    assert [*SandboxRecord.field_names(), "job"] == columns
    assert set(_record().row()) == set(columns)


def test_a_record_goes_through_the_store_unchanged(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'corral.db'}")
    try:
        record = _record()
        store.insert(record)
        assert store.get(record.id) == record
        assert store.list(labels={"job": "j-9"}) == [record]  # the job column is the label's copy
        other = dataclasses.replace(record, id="sb-e4-00000000000000f2", labels={})
        store.insert_many([other])
        assert store.get(other.id) == other and other.job is None
        store.end(record.id, SandboxState.ENDED, "killed", "by test")
        ended = store.get(record.id)
        assert ended is not None and ended.ended_at is not None
        assert (ended.state, ended.end_reason, ended.status_message) == ("ended", "killed", "by test")
    finally:
        store.close()


def test_the_spec_is_what_the_create_asked_for() -> None:
    spec = _record().to_spec(_LAYERS, restore_from="/ckpt")
    assert (spec.sandbox_id, spec.image, spec.layers, spec.backend, spec.runtime) == (
        "sb-e4-00000000000000f1", "debian-12", _LAYERS, "container", "runc")  # fmt: skip
    assert (spec.cpu, spec.qos, spec.memory_mb, spec.pids_max, spec.disk_mb) == (0.5, "batch", 96, 64, 256)
    assert (spec.env, spec.cwd, spec.user, spec.idle_pause_s) == ({"TASK": "t-3"}, "/work", "1000:1000", 30)
    assert spec.network == (AllowRule(cidr="10.88.200.0/24", ports=(443,)), AllowRule(host="pypi.org"))
    assert (spec.protected_paths, spec.sensitive_paths) == (("/work/tests/",), ("/work/hidden/",))
    assert spec.setuid_allowed and spec.restore_from == "/ckpt"
    assert _record().to_spec(_LAYERS).restore_from is None
    loopback = dataclasses.replace(_record(), network=None, labels={}, protected_paths=None, sensitive_paths=None)
    spec = loopback.to_spec(_LAYERS)
    assert spec.network is None and not spec.setuid_allowed and spec.protected_paths == spec.sensitive_paths == ()


def test_a_fork_or_replay_asks_for_the_same_sandbox() -> None:
    """Every setting of the create but the image (its layers instead) and the network (a container fork starts
    on loopback; a checkpointed one passes the network as an override); labels are added to, TTL keeps its
    length."""
    like = _record().to_request(labels={"corral.forked_from": "sb-e4-00000000000000f1"})
    asked = _REQUEST.model_dump(exclude={"image", "environment", "layers", "network", "labels"})
    assert like.model_dump(exclude={"image", "environment", "layers", "network", "labels"}) == asked
    assert like.layers == ["sha256:" + "a" * 64, "sha256:" + "b" * 64] and like.network is None
    assert like.labels == {**_REQUEST.labels, "corral.forked_from": "sb-e4-00000000000000f1"}
    replay = _record().to_request(labels={}, ttl_s=5, network=_record().network)
    assert replay.ttl_s == 5 and replay.network == _REQUEST.network
    assert dataclasses.replace(_record(), expires_at=None).to_request(labels={}).ttl_s is None


def test_a_client_reads_the_records_values() -> None:
    info = _record().to_info(state=SandboxState.RUNNING.value, status_message="up")
    assert (info.id, info.edge_id, info.state, info.image, info.runtime) == (
        "sb-e4-00000000000000f1", "e4", SandboxState.RUNNING, "debian-12", "runc")  # fmt: skip
    assert (info.created_at, info.expires_at, info.ttl_counts_paused, info.idle_pause_s) == (1000.0, 1090.0, True, 30)
    assert info.network == _REQUEST.network and info.node_selector == {"zone": "b"} and info.disk_mb == 256
    assert info.labels == _REQUEST.labels and info.status_message == "up"


def test_the_layers_in_use_are_those_of_active_sandboxes(tmp_path: Path) -> None:
    """What a layer cache keeps and a layer helper goes on serving: the stacks of active sandboxes (an alias is
    its layer), of the edges asked about."""
    store = StateStore(f"sqlite:///{tmp_path / 'corral.db'}")
    try:
        a, b, c, d = ("sha256:" + x * 64 for x in "abcd")
        store.insert_many([
            sandbox_record("sb-e1-00000000000000a1", "e1", layers=[a, f"{a}#1"]),
            sandbox_record("sb-e2-00000000000000a2", "e2", layers=[b], state="paused"),
            sandbox_record("sb-e2-00000000000000a3", "e2", layers=[c], state="ended"),
            sandbox_record("sb-e3-00000000000000a4", "e3", layers=[d], state="creating"),
        ])  # fmt: skip
        assert store.layers_in_use() == {a, b, d}
        assert store.layers_in_use(["e1", "e2"]) == {a, b}
        assert store.layers_in_use([]) == set()
    finally:
        store.close()
