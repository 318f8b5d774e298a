"""`python -m corral.backends.vm.setup`: prepare this node for VM sandboxes ahead of the first create.

Builds the static guest agent, downloads and unpacks the guest kernel, builds
the initramfs, probes the accelerator and builds the full-VM root disks of the
base images, so the first microvm/vm create does not pay for it.
scripts/setup.sh runs it; it is quick when nothing changed.
"""

from __future__ import annotations

import logging
import sys

from corral.backends.container.host import build_native_helpers
from corral.backends.vm.accel import choose_accelerator
from corral.backends.vm.backend import DEFAULT_DISK_MB, root_disk_image
from corral.backends.vm.guest import GuestKitError, ensure_guest_kit
from corral.config import Settings
from corral.images.store import LayerStore
from corral.sdk._exceptions import NotFound

# Images whose full-VM root disk (an ext4 built from their layers) is made ahead of the first create.
FULL_VM_IMAGES = ("debian-12-systemd",)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="setup: %(message)s")
    settings = Settings()
    helpers = build_native_helpers(settings.node_dir)
    try:
        kit = ensure_guest_kit(settings.node_dir, helpers.agent)
    except GuestKitError as exc:
        print(f"setup: error: {exc}", file=sys.stderr)
        return 1
    accel = choose_accelerator(kit, settings.node_dir / "vm", settings.vm_accel)
    print(f"setup: VM guest kernel {kit.kernel_version} ok; accelerator {accel.name} ({accel.reason})")
    store = LayerStore(settings.layer_dir)
    for image in FULL_VM_IMAGES:
        try:
            record = store.resolve(image)
        except NotFound:
            continue
        layers = tuple(store.layer_path(digest) for digest in record.layers)
        disk = root_disk_image(settings.node_dir / "vm", layers, DEFAULT_DISK_MB)
        print(f"setup: root disk for backend=vm image {image} ok ({disk.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
