"""The ``e2b-base`` image behind E2B's ``base`` template: debian-12 plus what E2B users assume.

debian-12 already has bash, python3, coreutils and the user ``user`` (uid
1000, home /home/user). This adds a layer with Debian's ``sudo`` package
(fetched on the host with ``apt-get download``, unpacked with ``dpkg-deb``)
and ``user ALL=(ALL:ALL) NOPASSWD: ALL``. The facade's sandboxes allow
setuid programs (``corral.setuid``), so ``user`` gets root inside the
sandbox through sudo, within the sandbox's seccomp filter and capability
bounding set (docs/e2b.md).
``python -m corral.gateway.e2b.template`` builds it once per node
(scripts/setup.sh); a new debian-12 rebuilds it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from corral.api.errors import CorralError, NotFound
from corral.images.bases import CHECK_HAS_WORK, DEFAULT_STORE_DIR, DEFAULT_WORK_DIR, ensure_base_images
from corral.images.erofs import build_erofs
from corral.images.store import ImageRecord, LayerStore

__all__ = ["IMAGE_NAME", "current_e2b_base", "ensure_e2b_base", "main"]

IMAGE_NAME = "e2b-base"
_ON = "debian-12"
_PACKAGES = ("sudo",)
_SUDOERS = "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
_TIMEOUT_S = 300
_RECIPE = "2"  # bump when the layer's contents change: setup rebuilds images made by an older recipe


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _build_rootfs(rootfs: Path, downloads: Path) -> None:
    _run(["apt-get", "download", *_PACKAGES], downloads)
    for deb in sorted(downloads.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(rootfs)], downloads)
    for top in ("bin", "sbin", "lib", "lib64"):  # debian-12 is merged-/usr: /lib is a symlink the layer must not shadow
        if (rootfs / top).is_dir() and not (rootfs / top).is_symlink():
            shutil.copytree(rootfs / top, rootfs / "usr" / top, symlinks=True, dirs_exist_ok=True)
            shutil.rmtree(rootfs / top)
    sudoers = rootfs / "etc/sudoers.d/user"
    sudoers.parent.mkdir(parents=True, exist_ok=True)
    sudoers.write_text(_SUDOERS)
    os.chmod(sudoers, 0o440)
    os.chmod(rootfs, 0o755)  # the layer's "/" shadows the lower layers' attributes


def current_e2b_base(store: LayerStore, debian: ImageRecord) -> ImageRecord | None:
    """``e2b-base:latest`` if it exists, on this ``debian`` and by this recipe; else None (it needs a build)."""
    try:
        record = store.resolve(IMAGE_NAME)
        made_by = store.layer(record.layers[-1]).labels.get("e2b_recipe")
    except NotFound:
        return None
    if record.layers[: len(debian.layers)] == debian.layers and made_by == _RECIPE:
        return record
    return None


def ensure_e2b_base(store: LayerStore, work_dir: Path) -> ImageRecord:
    """``e2b-base:latest``, built if it is missing, or was built on another debian-12 or by an older recipe."""
    (debian,) = ensure_base_images(store, [_ON], work_dir=work_dir)
    current = current_e2b_base(store, debian)
    if current is not None:
        return current
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="e2b-base.", dir=work_dir) as scratch:
        rootfs, downloads = Path(scratch) / "rootfs", Path(scratch) / "debs"
        rootfs.mkdir()
        downloads.mkdir()
        os.chmod(downloads, 0o777)  # apt drops to _apt for downloads when it can
        _build_rootfs(rootfs, downloads)
        image_file = Path(scratch) / "layer.erofs"
        build_erofs(rootfs, image_file)
        layer = store.import_layer(
            image_file, kind="tools", labels={"source": "apt-get download sudo", "e2b_recipe": _RECIPE}, move=True
        )
        shutil.rmtree(rootfs)
    return store.tag(IMAGE_NAME, [*debian.layers, layer.digest])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral.gateway.e2b.template", description=__doc__)
    parser.add_argument("--store", type=Path, default=DEFAULT_STORE_DIR, help="layer store root")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch space")
    parser.add_argument(
        "--check", action="store_true", help=f"build nothing; say whether it is missing (exit {CHECK_HAS_WORK} if so)"
    )
    args = parser.parse_args(argv)
    if args.check:
        store = LayerStore(args.store, inspect_only=True)
        try:
            debian = store.resolve(_ON)
        except NotFound:
            debian = None
        if debian is not None and current_e2b_base(store, debian) is not None:
            return 0
        print(f"setup: would build the E2B template {IMAGE_NAME} ({_ON} + sudo) into {args.store}", flush=True)
        return CHECK_HAS_WORK
    try:
        record = ensure_e2b_base(LayerStore(args.store), args.work_dir)
    except (CorralError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"images: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"images: {record.ref} ok ({len(record.layers)} layers, {record.size_bytes / 1e6:.1f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
