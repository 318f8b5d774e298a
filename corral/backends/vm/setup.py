"""`python -m corral.backends.vm.setup`: prepare this node for VM sandboxes ahead of the first create.

Builds the static guest agent, downloads and unpacks the guest kernel, builds
the initramfs and probes the accelerator, so the first microvm/vm create does
not pay for it. scripts/setup.sh runs it; it is quick when nothing changed.
"""

from __future__ import annotations

import logging
import sys

from corral.backends.container.host import build_native_helpers
from corral.backends.vm.accel import choose_accelerator
from corral.backends.vm.guest import GuestKitError, ensure_guest_kit
from corral.config import Settings


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
