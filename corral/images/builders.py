"""Builders that turn a source into one EROFS layer, without a sandbox.

Each builder returns the cache key of its inputs (`input_key`) and, when
asked to build, a directory tree that becomes the layer. They run in worker
threads (they block on disk and subprocesses) and report progress through a
callback. Builders that need a sandbox (commands, git setup steps) live in
corral/gateway/builds.py and reuse ``pack_tree`` from here.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from corral.api.errors import InvalidRequest, NotFound
from corral.images.bases import build_debian_rootfs, debian_mirror
from corral.images.catalogue import Catalogue, CatalogueLayer
from corral.images.erofs import build_erofs
from corral.images.image_config import ImageConfig, from_oci
from corral.images.unpack import extract_tar, unpack_oci_archive

__all__ = ["Progress", "LayerBuilder"]

Progress = Callable[[str], None]
_GIT_TIMEOUT_S = 600.0


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _tree_signature(root: Path) -> str:
    """Paths, sizes, modes and mtimes of a tree: changes when its files do (cheap, no content hashing)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest.update(f"{path.relative_to(root)}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _git(args: list[str], cwd: Path | None = None) -> str:
    run = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    if run.returncode != 0:
        raise InvalidRequest(f"git {' '.join(args[:2])} failed: {run.stderr.strip()[-500:]}")
    return run.stdout.strip()


class LayerBuilder:
    """Builds layers into the catalogue's store; one instance per server."""

    def __init__(self, catalogue: Catalogue, work_dir: Path, max_archive_bytes: int) -> None:
        self.catalogue = catalogue
        self._work_dir = work_dir
        self._max_bytes = max_archive_bytes
        work_dir.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def scratch(self, prefix: str) -> Iterator[Path]:
        """An empty directory removed afterwards, whatever happens."""
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self._work_dir))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def pack_tree(
        self, tree: Path, *, kind: str, parents: tuple[str, ...], source: dict[str, Any], progress: Progress
    ) -> CatalogueLayer:
        """mkfs.erofs the tree, store the file under its digest, record it in the catalogue."""
        with self.scratch("pack-") as scratch:
            progress(f"mkfs.erofs {tree.name or tree}")
            image = build_erofs(tree, scratch / "layer.erofs")
            record = self.catalogue.store.import_layer(image, kind=kind, move=True)
        progress(f"layer {record.digest[:19]}… {record.size_bytes / 1e6:.1f} MB")
        return self.catalogue.add_layer(record, parents=parents, source=source)

    def pack_file(
        self, image: Path, *, kind: str, parents: tuple[str, ...], source: dict[str, Any], progress: Progress
    ) -> CatalogueLayer:
        """Store an EROFS file made elsewhere (a sandbox's packed diff) and record it."""
        record = self.catalogue.store.import_layer(image, kind=kind, move=True)
        progress(f"layer {record.digest[:19]}… {record.size_bytes / 1e6:.1f} MB")
        return self.catalogue.add_layer(record, parents=parents, source=source)

    # -- inputs (cache keys) --------------------------------------------

    def inputs(self, kind: str, *, path: str | None, commit: str | None, workspace_path: str,
               suite: str, packages: list[str]) -> dict[str, Any]:  # fmt: skip
        """What identifies a build of this kind; equal inputs give the cached layer."""
        if kind in ("dir", "tar", "oci", "git") and not path:
            raise InvalidRequest(f"a {kind} build needs `path` (on the server's machine)")
        if kind == "dir":
            root = self._existing(path, directory=True)
            return {"builder": "dir", "path": str(root), "tree": _tree_signature(root)}
        if kind in ("tar", "oci"):
            source = self._existing(path, directory=False)
            return {"builder": kind, "path": str(source), "sha256": _file_sha256(source)}
        if kind == "debootstrap":
            return {
                "builder": "debootstrap",
                "suite": suite,
                "packages": sorted(packages),
                "mirror": debian_mirror(suite),
            }
        if kind == "git":
            repo = self._existing(path, directory=True)
            resolved = _git(["rev-parse", "--verify", f"{commit or 'HEAD'}^{{commit}}"], cwd=repo)
            return {"builder": "git", "repo": str(repo), "commit": resolved, "workspace_path": workspace_path}
        raise InvalidRequest(f"{kind} builds are not built from a source tree")

    @staticmethod
    def _existing(path: str | None, *, directory: bool) -> Path:
        resolved = Path(path or "").resolve()
        if directory and not resolved.is_dir():
            raise NotFound(f"no directory {resolved} on the server's machine")
        if not directory and not resolved.is_file():
            raise NotFound(f"no file {resolved} on the server's machine")
        return resolved

    # -- trees ----------------------------------------------------------

    def make_tree(
        self, inputs: dict[str, Any], dest: Path, *, packages: list[str], progress: Progress
    ) -> tuple[Path, ImageConfig | None]:
        """Produce the layer's tree for these inputs under the empty directory ``dest``: the tree root, and the
        image config the source carries (an OCI archive's), if any."""
        builder = inputs["builder"]
        if builder == "dir":
            return Path(inputs["path"]), None  # packed in place: no copy
        if builder == "tar":
            progress("extracting tar")
            with open(self._source_file(inputs), "rb") as source:
                count = extract_tar(source, dest, max_bytes=self._max_bytes, progress=progress)
            progress(f"{count} entries extracted")
            return dest, None
        if builder == "oci":
            info = unpack_oci_archive(self._source_file(inputs), dest, max_bytes=self._max_bytes, progress=progress)
            progress(f"{len(info.layer_digests)} OCI layers applied")
            return dest, from_oci(info.config)
        if builder == "debootstrap":
            progress(f"debootstrap {inputs['suite']} (about a minute)")
            build_debian_rootfs(dest, suite=inputs["suite"], packages=("ca-certificates", *packages))
            return dest, None
        if builder == "git":
            return self._checkout(inputs, dest, progress), None
        raise InvalidRequest(f"unknown builder {builder!r}")

    def _source_file(self, inputs: dict[str, Any]) -> Path:
        path = Path(inputs["path"])
        if _file_sha256(path) != inputs["sha256"]:
            raise InvalidRequest(f"{path} changed while it was being built: build again")
        return path

    def _checkout(self, inputs: dict[str, Any], dest: Path, progress: Progress) -> Path:
        target = dest / inputs["workspace_path"].strip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        progress(f"git clone {inputs['repo']} at {inputs['commit'][:12]}")
        _git(["clone", "--quiet", "--no-checkout", inputs["repo"], str(target)])
        _git(["-c", "advice.detachedHead=false", "checkout", "--quiet", inputs["commit"]], cwd=target)
        return dest
