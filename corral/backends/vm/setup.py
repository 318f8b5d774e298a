"""`python -m corral.backends.vm.setup`: prepare this node for VM sandboxes ahead of the first create.

Builds the static guest agent, downloads and unpacks the guest kernel, builds
the initramfs, probes the accelerator and builds the full-VM root disks of the
base images, so the first microvm/vm create does not pay for it.
scripts/setup.sh runs it; it is quick when nothing changed. ``--check`` builds
nothing and says which of those steps would run.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from corral.api.errors import NotFound
from corral.backends.common.host import build_native_helpers, native_helper_paths
from corral.backends.vm.accel import cached_accelerator, choose_accelerator
from corral.backends.vm.backend import DEFAULT_DISK_MB, root_disk_image, root_disk_path
from corral.backends.vm.guest import GuestKitError, ensure_guest_kit, guest_kit_paths
from corral.config import Settings
from corral.images.bases import CHECK_HAS_WORK
from corral.images.store import LayerStore

# Images whose full-VM root disk (an ext4 built from their layers) is made ahead of the first create.
FULL_VM_IMAGES = ("debian-12-systemd",)


def pending_steps(settings: Settings) -> list[str]:
    """What ``main`` would build on this node, in order; empty when the node is ready for VMs."""
    helpers = native_helper_paths(settings.node_dir)
    if not (helpers.agent.exists() and helpers.launch.exists()):
        return ["compile corral-agent and corral-launch", "build the VM guest kit (kernel, initramfs, KVM probe)"]
    steps = []
    try:
        kit = guest_kit_paths(settings.node_dir, helpers.agent)
    except (GuestKitError, OSError) as exc:
        return [f"build the VM guest kit ({exc})"]
    if not kit.initramfs.exists():
        steps.append(f"download the guest kernel {kit.kernel_version} and build the initramfs")
    probed = kit.initramfs.exists() and cached_accelerator(kit, settings.node_dir / "vm") is not None
    if settings.vm_accel == "auto" and not probed:
        steps.append("probe whether guests boot under KVM (else TCG)")
    store = LayerStore(settings.layer_dir, inspect_only=True)
    for image in FULL_VM_IMAGES:
        try:
            record = store.resolve(image)
        except NotFound:
            steps.append(f"build the full-VM root disk of {image} (once the image exists)")
            continue
        layers = tuple(store.layer_path(digest) for digest in record.layers)
        if not root_disk_path(settings.node_dir / "vm", layers, DEFAULT_DISK_MB).exists():
            steps.append(f"build the full-VM root disk of {image}")
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral.backends.vm.setup", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help=f"build nothing; say what would be built (exit {CHECK_HAS_WORK} if any)"
    )
    args = parser.parse_args(argv)
    settings = Settings()
    if args.check:
        steps = pending_steps(settings)
        for step in steps:
            print(f"setup: would {step}", flush=True)
        return CHECK_HAS_WORK if steps else 0
    logging.basicConfig(level=logging.INFO, format="setup: %(message)s")
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
