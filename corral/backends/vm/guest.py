"""The guest side a VM sandbox boots: Debian's kernel plus an initramfs of our own.

The initramfs holds only what the project ships: busybox (static), the
corral-agent built for guests (static) and the kernel modules the init script
loads (virtio transports, block, console, balloon, net, EROFS, overlay, ext4),
so a guest needs nothing from the sandbox's image. Everything is built once per
node into ``<node_dir>/vm/<key>/`` where the key hashes every input, and reused.
"""

from __future__ import annotations

import hashlib
import logging
import lzma
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GuestKit",
    "GuestKitError",
    "ensure_guest_kit",
    "guest_kit_paths",
    "kernel_package",
    "extract_vmlinux",
    "module_closure",
]

log = logging.getLogger("corral.vm")

KERNEL_META_PACKAGE = "linux-image-amd64"
BUSYBOX = Path("/bin/busybox")
# What the init script needs, by module name; their dependencies are added from modules.dep.
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "virtio_balloon",
    "virtio_net",
    "crc32c_generic",
    "erofs",
    "overlay",
    "ext4",
)
_XZ_MAGIC = b"\xfd7zXZ\x00"
_INIT_SCRIPT = Path(__file__).with_name("init.sh")
KIT_FORMAT = 2  # bump when the initramfs layout changes (its inputs are hashed, this code is not)


class GuestKitError(RuntimeError):
    """The guest kernel or initramfs could not be prepared (no package, no network to the mirror, ...)."""


@dataclass(frozen=True)
class GuestKit:
    kernel_version: str
    vmlinux: Path  # uncompressed PVH ELF: what -M microvm boots
    bzimage: Path  # the package's vmlinuz: what q35 boots through its firmware's loader
    initramfs: Path


def kernel_package() -> str:
    """The versioned kernel package Debian's meta package points at (e.g. linux-image-6.1.0-57-amd64)."""
    out = subprocess.run(["apt-cache", "depends", KERNEL_META_PACKAGE], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split(":", 1)[1].strip()
    raise GuestKitError(f"apt-cache knows no kernel behind {KERNEL_META_PACKAGE}: {out.stderr.strip()}")


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage whose payload is xz-compressed (Debian's)."""
    start = bzimage.find(_XZ_MAGIC)
    while start >= 0:
        try:
            data = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[start:])
        except lzma.LZMAError:
            data = b""
        if data.startswith(b"\x7fELF"):
            return data
        start = bzimage.find(_XZ_MAGIC, start + 1)
    raise GuestKitError("no xz-compressed ELF kernel found inside the bzImage")


def module_closure(modules_dep: str, wanted: tuple[str, ...]) -> list[str]:
    """Module files (relative to the modules dir) for ``wanted`` and their dependencies, each after what it needs."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in modules_dep.splitlines():
        if ":" not in line:
            continue
        path, rest = line.split(":", 1)
        deps[path] = rest.split()
        by_name[Path(path).name.split(".ko")[0].replace("-", "_")] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        found = by_name.get(name.replace("-", "_"))
        if found is None:
            raise GuestKitError(f"the guest kernel has no module {name}")
        visit(found)
    return order


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fetch_kernel(cache: Path, package: str) -> Path:
    """The kernel .deb, downloaded once per node with apt (the only registry this needs)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    log.info("downloading the guest kernel %s (about 70 MB, once per node)", package)
    done = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True, text=True)
    found = sorted(cache.glob(f"{package}_*.deb"))
    if done.returncode != 0 or not found:
        raise GuestKitError(f"apt-get download {package} failed: {done.stderr.strip()[-500:]}")
    return found[-1]


_build_lock = threading.Lock()


def ensure_guest_kit(node_dir: Path, guest_agent: Path) -> GuestKit:
    """Build (or reuse) the kernel and initramfs for guests of this node."""
    with _build_lock:
        return _ensure_guest_kit(node_dir, guest_agent)


def guest_kit_paths(node_dir: Path, guest_agent: Path, package: str | None = None) -> GuestKit:
    """Where the kit for this kernel package, agent and init is (or will be); builds nothing."""
    package = package or kernel_package()
    version = package.removeprefix("linux-image-")
    key = hashlib.sha256(
        "|".join(
            [str(KIT_FORMAT), package, _sha(guest_agent), _sha(BUSYBOX), _sha(_INIT_SCRIPT), ",".join(GUEST_MODULES)]
        ).encode()
    ).hexdigest()[:16]
    kit_dir = node_dir / "vm" / f"kit-{version}-{key}"
    return GuestKit(version, kit_dir / "vmlinux", kit_dir / "vmlinuz", kit_dir / "initramfs.cpio")


def _ensure_guest_kit(node_dir: Path, guest_agent: Path) -> GuestKit:
    vm_dir = node_dir / "vm"
    package = kernel_package()
    kit = guest_kit_paths(node_dir, guest_agent, package)
    if kit.initramfs.exists():
        return kit
    version, kit_dir = kit.kernel_version, kit.initramfs.parent
    deb = _fetch_kernel(vm_dir / "debs", package)
    vm_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=vm_dir, prefix=".build-") as tmp:
        work = Path(tmp)
        unpacked = work / "deb"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True, capture_output=True)
        staging = work / "kit"
        staging.mkdir()
        bzimage = (unpacked / "boot" / f"vmlinuz-{version}").read_bytes()
        (staging / "vmlinuz").write_bytes(bzimage)
        (staging / "vmlinux").write_bytes(extract_vmlinux(bzimage))
        modules_dir = unpacked / "lib" / "modules" / version
        # The package ships no modules.dep (its postinst makes it): build it the same way.
        subprocess.run(["depmod", "-b", str(unpacked), version], check=True, capture_output=True)
        order = module_closure((modules_dir / "modules.dep").read_text(), GUEST_MODULES)
        _build_initramfs(staging / "initramfs.cpio", work / "root", guest_agent, modules_dir, order)
        if kit_dir.exists():
            shutil.rmtree(kit_dir)
        staging.rename(kit_dir)
    log.info("guest kit for kernel %s ready in %s", version, kit_dir)
    return kit


def _build_initramfs(dest: Path, root: Path, agent: Path, modules_dir: Path, order: list[str]) -> None:
    for sub in ("bin", "lib/modules", "proc", "sys", "dev", "layers", "scratch", "sysroot"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    shutil.copy2(agent, root / "agent")
    shutil.copy2(_INIT_SCRIPT, root / "init")
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")  # for tools the agent runs outside the sandbox
    os.chmod(root / "init", 0o755)
    names = []
    for relative in order:
        name = Path(relative).name
        shutil.copy2(modules_dir / relative, root / "lib" / "modules" / name)
        names.append(name)
    (root / "modules.order").write_text("\n".join(names) + "\n")
    listing = subprocess.run(["find", ".", "-mindepth", "1"], cwd=root, capture_output=True, check=True).stdout
    with dest.open("wb") as out:
        subprocess.run(
            ["cpio", "--quiet", "-o", "-H", "newc", "--owner=0:0"], cwd=root, input=listing, stdout=out, check=True
        )
