"""Choose KVM or TCG by booting a guest, not by looking for /dev/kvm.

A /dev/kvm can exist and still not run stock kernels (this project's CI hosts
expose a nested PVM device under which a PVH kernel dies with an emulation
failure). So the probe boots the real guest kernel and initramfs with
``corral.probe=1``, which prints a marker and powers off, and gives it a
bounded time. The answer is cached per host kernel, QEMU and guest kit.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

from corral.backends.vm.guest import GuestKit
from corral.backends.vm.qemu import QEMU_BINARY, Accelerator, host_tsc_khz, timing_arguments

__all__ = ["cached_accelerator", "choose_accelerator", "probe_boot", "probe_kvm"]

log = logging.getLogger("corral.vm")

PROBE_MARKER = b"CORRAL-PROBE-OK"
PROBE_TIMEOUT_S = 8.0


def probe_kvm(kit: GuestKit, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot the guest under KVM once; (works, what happened)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "no usable /dev/kvm"
    return probe_boot(kit, "kvm", timeout_s)


def probe_boot(kit: GuestKit, accel: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot the guest kit with ``accel`` until its init prints the probe marker, for at most ``timeout_s``."""
    cpu = "host,-arch-capabilities" if accel == "kvm" else "max"
    with tempfile.TemporaryDirectory(prefix="corral-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        argv = [
            QEMU_BINARY, "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on", "-accel", accel,
            "-cpu", cpu, "-m", "128M", "-smp", "1", "-nodefaults", "-no-user-config",
            "-display", "none", "-no-reboot", "-kernel", str(kit.vmlinux), "-initrd", str(kit.initramfs),
            "-append", " ".join(["console=ttyS0 panic=-1 quiet corral.probe=1",
                                 *timing_arguments(host_tsc_khz() if accel == "tcg" else None)]),
            "-serial", f"file:{console}",
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while time.monotonic() - started < timeout_s:
                if console.exists() and PROBE_MARKER in console.read_bytes():
                    return True, f"a guest booted under {accel.upper()} in {time.monotonic() - started:.1f}s"
                if proc.poll() is not None:
                    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip()
                    return (
                        False,
                        f"QEMU under {accel.upper()} exited with {proc.returncode}: {err[-300:] or 'no output'}",
                    )
                time.sleep(0.05)
            return False, f"no guest booted under {accel.upper()} within {timeout_s:.0f}s (it cannot run this kernel)"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _qemu_version() -> str:
    out = subprocess.run([QEMU_BINARY, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def _probe_key(kit: GuestKit) -> str:
    """What the probe's answer depends on: a new host kernel, QEMU or guest kernel probes again."""
    return f"{platform.release()}|{_qemu_version()}|{kit.kernel_version}"


def cached_accelerator(kit: GuestKit, cache_dir: Path) -> Accelerator | None:
    """The probe's remembered answer for this host, QEMU and guest kernel; None if it must probe."""
    try:
        cached = json.loads((cache_dir / "accel.json").read_text())
        if cached.get("key") == _probe_key(kit):
            return Accelerator(cached["name"], cached["reason"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def choose_accelerator(kit: GuestKit, cache_dir: Path, wanted: str = "auto") -> Accelerator:
    """``wanted``: "auto" (probe KVM, fall back to TCG), "kvm" or "tcg" (forced, no probe)."""
    if wanted == "tcg":
        return Accelerator("tcg", "TCG chosen by configuration (CORRAL_VM_ACCEL=tcg)")
    if wanted == "kvm":
        return Accelerator("kvm", "KVM chosen by configuration (CORRAL_VM_ACCEL=kvm)")
    cached = cached_accelerator(kit, cache_dir)
    if cached is not None:
        return cached
    key = _probe_key(kit)
    cache = cache_dir / "accel.json"
    works, what = probe_kvm(kit)
    choice = Accelerator("kvm", what) if works else Accelerator("tcg", f"TCG (software emulation): {what}")
    log.info("VM accelerator: %s (%s)", choice.name, choice.reason)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".accel.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps({"key": key, "name": choice.name, "reason": choice.reason}))
    os.replace(tmp, cache)  # never write through a hard link a test node dir shares
    return choice
