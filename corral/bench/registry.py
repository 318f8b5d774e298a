"""Real OCI registries on loopback for `corral bench pull` and the tests: Debian's docker-registry (the CNCF
distribution server), and OCI image layouts written with tarfile and pushed into it with skopeo.

Each registry gets a free port on 127.0.0.1, a config file and filesystem storage under a directory of the
caller's, and serves plain HTTP or, given a certificate, https; its access log (stdout) tells which requests
reached it and how many bytes it sent. Stopped by PID.
Needs the Debian packages docker-registry, skopeo and (for htpasswd_file) apache2-utils.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import ssl
import subprocess
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from corral.embedded import free_port

__all__ = [
    "Blob",
    "Member",
    "Registry",
    "ServerCertificate",
    "htpasswd_file",
    "image_blobs",
    "layer_tar",
    "push",
    "start_registry",
    "tree_members",
    "write_index_layout",
    "write_layout",
]

REGISTRY_BINARY = "/usr/bin/docker-registry"
START_TIMEOUT_S = 20.0
_ACCESS_RE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<bytes>\d+|-)')

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

# A layer member: path -> bytes (a file), None (a directory), or ("symlink", target).
Member = bytes | None | tuple[str, str]


@dataclass(frozen=True)
class ServerCertificate:
    """An https certificate (PEM, chain first), its key, and the CA certificate it is checked against."""

    certificate: Path
    key: Path
    ca_certificate: Path


@dataclass
class Registry:
    """A running docker-registry; ``address`` is host:port."""

    root: Path
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    def storage_blob(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes."""
        hex_digest = digest.removeprefix("sha256:")
        return self.root / "storage/docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"

    def access_log(self) -> list[dict[str, str]]:
        """Every request the registry answered so far: method, path, status, bytes."""
        entries = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            match = _ACCESS_RE.search(line)
            if match:
                entries.append(match.groupdict())
        return entries

    def blob_bytes_sent(self, repository: str, *, since: int = 0) -> int:
        """Bytes of blob bodies sent for ``repository`` (GET .../blobs/... answered 200 or 206), counting from
        access log entry ``since`` (``len(access_log())`` taken before)."""
        prefix = f"/v2/{repository}/blobs/"
        return sum(
            int(entry["bytes"])
            for entry in self.access_log()[since:]
            if entry["method"] == "GET" and entry["path"].startswith(prefix) and entry["status"] in ("200", "206")
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_registry(root: Path, *, htpasswd: Path | None = None, tls: ServerCertificate | None = None) -> Registry:
    """docker-registry on 127.0.0.1 and a free port, storage under ``root``; Basic auth from ``htpasswd``;
    https only with ``tls``'s certificate."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    http: dict[str, object] = {"addr": f"127.0.0.1:{port}"}
    config = {
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(root / "storage")}, "delete": {"enabled": True}},
        "http": http,
    }
    if htpasswd is not None:
        config["auth"] = {"htpasswd": {"realm": "corral-test", "path": str(htpasswd)}}
    if tls is not None:
        http["tls"] = {"certificate": str(tls.certificate), "key": str(tls.key)}
    config_path = root / "config.json"  # YAML is a superset of JSON
    config_path.write_text(json.dumps(config))
    log_path = root / "registry.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [REGISTRY_BINARY, "serve", str(config_path)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    registry = Registry(root=root, address=f"127.0.0.1:{port}", process=process, log_path=log_path,
                        scheme="https" if tls else "http")  # fmt: skip
    verify = ssl.create_default_context(cafile=str(tls.ca_certificate)) if tls else True
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{registry.url}/v2/", timeout=1.0, verify=verify).status_code in (200, 401):
                return registry
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            registry.stop()
            raise RuntimeError(f"docker-registry did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)


def htpasswd_file(path: Path, user: str, password: str) -> Path:
    """A bcrypt htpasswd file (what the distribution registry accepts), made by apache2-utils' htpasswd."""
    line = subprocess.run(["htpasswd", "-Bbn", user, password], capture_output=True, text=True, check=True).stdout
    path.write_text(line.strip() + "\n")
    return path


# -- OCI image layouts ------------------------------------------------------


def layer_tar(members: dict[str, Member]) -> bytes:
    """A gzip-compressed layer tar; names are written in the order given (parents before children)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(content, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, content[1]
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o755 if name.startswith("bin/") else 0o644
                tar.addfile(info, io.BytesIO(content))
    return gzip.compress(raw.getvalue(), mtime=0)


def tree_members(root: Path) -> dict[str, Member]:
    """A directory tree (e.g. build_busybox_rootfs output) as layer members."""
    members: dict[str, Member] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            members[name] = ("symlink", str(path.readlink()))
        elif path.is_dir():
            members[name] = None
        else:
            members[name] = path.read_bytes()
    return members


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return f"sha256:{hashlib.sha256(self.data).hexdigest()}"

    def descriptor(self, **extra: object) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


def image_blobs(layers: Sequence[bytes], config: dict[str, object], architecture: str = "amd64") -> list[Blob]:
    """[manifest, config, *layers] of one image."""
    layer_blobs = [Blob(OCI_LAYER_GZIP, data) for data in layers]
    diff_ids = [f"sha256:{hashlib.sha256(gzip.decompress(data)).hexdigest()}" for data in layers]
    config_blob = Blob(OCI_CONFIG, json.dumps({
        "architecture": architecture, "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }).encode())  # fmt: skip
    manifest = Blob(OCI_MANIFEST, json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_blob.descriptor(),
        "layers": [blob.descriptor() for blob in layer_blobs],
    }).encode())  # fmt: skip
    return [manifest, config_blob, *layer_blobs]


def write_layout(directory: Path, tag: str, image: list[Blob]) -> Path:
    """An OCI image layout holding one image (``[manifest, config, *layers]``) tagged ``tag``."""
    _put_blobs(directory, image)
    _write_index(directory, image[0].descriptor(annotations={"org.opencontainers.image.ref.name": tag}))
    return directory


def write_index_layout(directory: Path, tag: str, platforms: list[tuple[list[Blob], str]]) -> Path:
    """An OCI image layout whose ``tag`` is an image index: one image per (blobs, architecture), all linux."""
    entries = []
    for blobs, architecture in platforms:
        _put_blobs(directory, blobs)
        entries.append(blobs[0].descriptor(platform={"os": "linux", "architecture": architecture}))
    index = Blob(OCI_INDEX, json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode())
    _put_blobs(directory, [index])
    _write_index(directory, index.descriptor(annotations={"org.opencontainers.image.ref.name": tag}))
    return directory


def _put_blobs(directory: Path, blobs: Sequence[Blob]) -> None:
    blobs_dir = directory / "blobs" / "sha256"
    blobs_dir.mkdir(parents=True, exist_ok=True)
    for blob in blobs:
        (blobs_dir / blob.digest.removeprefix("sha256:")).write_bytes(blob.data)


def _write_index(directory: Path, top: dict[str, object]) -> None:
    (directory / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (directory / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [top]}))


def push(layout: Path, tag: str, registry: Registry, repository: str, *, creds: str | None = None,
         docker_format: bool = False) -> None:  # fmt: skip
    """skopeo copy the layout's ``tag`` (every platform of an index) to ``registry/repository:tag``;
    ``docker_format``: as a Docker v2 schema 2 manifest instead of OCI."""
    argv = ["skopeo", "copy", "--all", "--quiet", "--dest-tls-verify=false"]
    argv += ["--dest-creds", creds] if creds else []
    argv += ["--format", "v2s2"] if docker_format else []
    argv += [f"oci:{layout}:{tag}", f"docker://{registry.address}/{repository}:{tag}"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"skopeo copy failed: {run.stderr}")
