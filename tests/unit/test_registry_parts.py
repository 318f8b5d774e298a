"""The parts of a registry pull that need no registry: references, auth files, one OCI layer unpacked with
overlayfs whiteouts (the registry tests run them end to end: tests/integration/test_registry.py)."""

from __future__ import annotations

import base64
import io
import json
import os
import stat
from pathlib import Path

import pytest

from corral.bench.registry import layer_tar
from corral.images.registry import RegistryConfig, is_registry_reference, load_auth_file, parse_reference
from corral.images.unpack import unpack_oci_layer
from corral.sdk import InvalidRequest

DIGEST = "sha256:" + "ab" * 32


def test_references() -> None:
    reference = parse_reference("127.0.0.1:5000/ns/img:v1.2")
    assert (reference.registry, reference.repository, reference.tag, reference.digest) == (
        "127.0.0.1:5000", "ns/img", "v1.2", None,
    )  # fmt: skip
    assert (reference.name, reference.version, str(reference)) == ("127.0.0.1:5000/ns/img", "v1.2",
                                                                   "127.0.0.1:5000/ns/img:v1.2")  # fmt: skip
    pinned = parse_reference(f"registry.example/a/b/c@{DIGEST}")
    assert pinned.version == DIGEST and str(pinned) == f"registry.example/a/b/c@{DIGEST}"
    assert parse_reference("localhost/img").version == "latest"
    for local in ("busybox", "debian-12:latest", "ns/img", "a/b:c"):
        assert not is_registry_reference(local)
    for bad in ("127.0.0.1:5000/NS/img", "127.0.0.1:5000/ns/img:", "host.x/img@sha256:12", "host.x//img"):
        with pytest.raises(InvalidRequest, match="malformed registry reference"):
            parse_reference(bad)


def test_auth_file(tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    encoded = base64.b64encode(b"alice:pa:ss").decode()
    path.write_text(json.dumps({"auths": {"https://reg.example:5000/v1/": {"auth": encoded},
                                          "other.example": {"username": "bob", "password": "pw"}}}))  # fmt: skip
    assert load_auth_file(path) == {"reg.example:5000": ("alice", "pa:ss"), "other.example": ("bob", "pw")}
    path.write_text(json.dumps({"auths": {"x.example": {"auth": base64.b64encode(b"nocolon").decode()}}}))
    with pytest.raises(InvalidRequest, match="no ':'"):
        load_auth_file(path)
    with pytest.raises(InvalidRequest, match="does not exist"):
        load_auth_file(tmp_path / "missing.json")


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts are device nodes: needs root")
def test_one_layer_keeps_whiteouts_as_overlayfs_does(tmp_path: Path) -> None:
    layer = layer_tar({
        "etc": None, "etc/.wh.passwd": b"", "etc/kept": b"k\n",
        "data": None, "data/.wh..wh..opq": b"", "data/new": b"n\n",
        "again": None, "again/.wh.same": b"", "again/same": b"written here\n",  # the same layer's entry wins
        "later": None, "later/same": b"first\n", "later/.wh.same": b"",  # ... in either order
    })  # fmt: skip
    tree = tmp_path / "tree"
    tree.mkdir()
    unpack_oci_layer(io.BytesIO(layer), tree, max_bytes=1 << 20, what="test layer")
    whiteout = os.lstat(tree / "etc/passwd")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert (tree / "etc/kept").read_text() == "k\n"
    assert os.getxattr(tree / "data", "trusted.overlay.opaque") == b"y"
    assert (tree / "data/new").read_text() == "n\n"
    assert (tree / "again/same").read_text() == "written here\n"
    assert (tree / "later/same").read_text() == "first\n"
    assert not any(name.startswith(".wh.") for _, _, names in os.walk(tree) for name in names)


def test_retry_delays_back_off_with_jitter_and_are_capped() -> None:
    config = RegistryConfig(backoff_s=0.2, max_delay_s=10.0)
    for retry, full_s in ((1, 0.2), (2, 0.4), (3, 0.8), (7, 10.0), (30, 10.0)):
        delays = [config.retry_delay_s(retry, None) for _ in range(50)]
        assert all(full_s / 2 <= delay <= full_s for delay in delays), (retry, delays)
        assert len(set(delays)) > 1  # jittered, so many pullers do not retry in step
    assert config.retry_delay_s(1, 3.0) == 3.0  # the registry's Retry-After, as it is
    assert config.retry_delay_s(1, 3600.0) == 10.0  # ... within the cap
