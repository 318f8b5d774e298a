"""VM sandboxes (microvm, vm) on QEMU."""
