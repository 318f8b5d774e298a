"""Images: EROFS layers, the node-wide LayerStore that holds them, base images.

A sandbox's root filesystem is an overlay of read-only EROFS layers named by
their sha256, plus a writable upper; this package builds and stores layers.
"""

from typing import Any

from corral.images.erofs import build_erofs
from corral.images.store import LAYER_KINDS, ImageRecord, LayerRecord, LayerStore

__all__ = [
    "BASE_IMAGE_NAMES",
    "LAYER_KINDS",
    "ImageRecord",
    "LayerRecord",
    "LayerStore",
    "build_busybox_rootfs",
    "build_debian_rootfs",
    "build_erofs",
    "ensure_base_images",
]

# bases.py is loaded on first use, not here: `python -m corral.images.bases`
# would otherwise find it already imported and warn.
_FROM_BASES = ("BASE_IMAGE_NAMES", "build_busybox_rootfs", "build_debian_rootfs", "ensure_base_images")


def __getattr__(name: str) -> Any:
    if name in _FROM_BASES:
        from corral.images import bases

        return getattr(bases, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
