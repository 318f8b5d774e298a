"""Corral's two base images, built once per node and reused by every server.

``busybox`` is a few MB and builds in about a second from the host's static
busybox; ``debian-12`` is a debootstrap minbase with bash, python3 and git
(about a minute). ``ensure_base_images()`` builds whichever is missing into
the node's LayerStore under a file lock, so concurrent setups build once.

``debian-12-toolchains`` is debian-12's packages plus Debian's C, C++, Java,
Go and Node.js toolchains, with Go's build cache filled for the standard
library (so a first ``go build`` in a sandbox compiles only its own code):
the SandboxFusion API (corral/gateway/sandbox_fusion.py) runs compiled
languages on it. It is large (see TOOLCHAIN_PACKAGES), so setup builds it only
when asked, and the server builds it on first use.

Every image carries the same identity: root, ``user`` (uid 1000, home
/home/user) and ``nobody``; hostname ``corral``; a localhost-only
/etc/hosts; an empty /etc/resolv.conf for the runtime to fill (the host's
would leak node-specific resolvers into a shared image).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Literal

from corral.api.errors import CorralError, InvalidRequest, NotFound
from corral.images.erofs import build_erofs
from corral.images.store import ImageRecord, LayerStore
from corral.procfs import mount_field

__all__ = [
    "BASE_IMAGE_NAMES",
    "CHECK_HAS_WORK",
    "GO_CACHE_DIR",
    "KNOWN_IMAGE_NAMES",
    "TOOLCHAIN_IMAGE",
    "TOOLCHAIN_PACKAGES",
    "DEBIAN_PACKAGES",
    "DEFAULT_STORE_DIR",
    "DEFAULT_WORK_DIR",
    "build_busybox_rootfs",
    "build_debian_rootfs",
    "debian_mirror",
    "ensure_base_images",
    "main",
    "missing_base_images",
]

BASE_IMAGE_NAMES = ("busybox", "debian-12", "debian-12-systemd")
# Exit status of a node-setup module's ``--check`` when it would build something (scripts/setup.sh reads it).
CHECK_HAS_WORK = 10
DEBIAN_PACKAGES = ("bash", "python3", "git", "ca-certificates", "coreutils")
# A whole operating system for backend="vm": the same packages plus an init system to hand PID 1 to.
SYSTEMD_PACKAGES = (*DEBIAN_PACKAGES, "systemd-sysv")
TOOLCHAIN_IMAGE = "debian-12-toolchains"
TOOLCHAIN_PACKAGES = (*DEBIAN_PACKAGES, "gcc", "g++", "libc6-dev", "default-jdk-headless", "golang-go", "nodejs")
KNOWN_IMAGE_NAMES = (*BASE_IMAGE_NAMES, TOOLCHAIN_IMAGE)
GO_CACHE_DIR = "/var/cache/go-build"  # GOCACHE in the image: sandboxes must set the same (and CGO_ENABLED=0)
_GO_WARM_TIMEOUT_S = 1200.0
DEFAULT_STORE_DIR = Path("/var/lib/corral/layers")
DEFAULT_WORK_DIR = Path("/var/tmp/corral-build")
DEFAULT_DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBOOTSTRAP_TIMEOUT_S = 1800.0
BUSYBOX_BINARY = Path("/bin/busybox")
SANDBOX_UID = 1000
_LOG_TAIL_LINES = 30
_KILL_GRACE_S = 10.0
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ETC_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"

Progress = Callable[[str], None]


# -- busybox ---------------------------------------------------------------


def build_busybox_rootfs(dest: Path) -> None:
    """A minimal rootfs: static busybox, one relative symlink per applet."""
    if not _is_static_elf(BUSYBOX_BINARY):
        raise RuntimeError(f"{BUSYBOX_BINARY} is missing or dynamically linked: install busybox-static")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)  # the image's "/": a mkdtemp() dest would be 0700
    for rel, mode in (
        ("bin", 0o755), ("usr/bin", 0o755), ("etc", 0o755), ("dev", 0o755), ("proc", 0o555),
        ("sys", 0o555), ("run", 0o755), ("tmp", 0o1777), ("var/tmp", 0o1777), ("root", 0o700),
        ("home/user", 0o755),
    ):  # fmt: skip
        (dest / rel).mkdir(parents=True, exist_ok=True)
        os.chmod(dest / rel, mode)
    shutil.copy2(BUSYBOX_BINARY, dest / "bin/busybox")
    applets = subprocess.run([str(BUSYBOX_BINARY), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        link = dest / "bin" / applet
        if applet != "busybox" and "/" not in applet and not link.is_symlink():
            link.symlink_to("busybox")
    (dest / "usr/bin/env").unlink(missing_ok=True)
    (dest / "usr/bin/env").symlink_to("../../bin/busybox")
    _write_text(
        dest / "etc/passwd",
        "root:x:0:0:root:/root:/bin/sh\n"
        f"user:x:{SANDBOX_UID}:{SANDBOX_UID}:user:/home/user:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    )
    _write_text(dest / "etc/group", f"root:x:0:\nuser:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
    _write_identity_files(dest)
    _chown_home(dest / "home/user")


# -- debian ----------------------------------------------------------------


def build_debian_rootfs(
    dest: Path,
    *,
    suite: str = "bookworm",
    packages: Sequence[str] = DEBIAN_PACKAGES,
    mirror: str | None = None,
    log_path: Path | None = None,
    timeout_s: float = DEBOOTSTRAP_TIMEOUT_S,
) -> None:
    """debootstrap a minbase Debian into ``dest``, then trim it and add ``user``.

    debootstrap's chatter goes to ``log_path`` (default: next to ``dest``);
    a failure raises RuntimeError carrying the log's last lines.
    """
    dest = Path(dest)
    mirror = mirror or debian_mirror(suite)
    log_path = Path(log_path or dest.with_name(f"{dest.name}.debootstrap.log"))
    debootstrap = shutil.which("debootstrap", path=_SBIN_PATH)
    if debootstrap is None:
        raise RuntimeError("debootstrap is not installed: run scripts/setup.sh")
    argv = [debootstrap, "--variant=minbase"]
    if packages:
        argv.append(f"--include={','.join(packages)}")
    argv += [suite, str(dest), mirror]
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)  # the image's "/": a mkdtemp() dest would be 0700
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PATH=_SBIN_PATH, LC_ALL="C", DEBIAN_FRONTEND="noninteractive")
    try:
        with open(log_path, "wb") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            returncode = _run_process_group(argv, log, env=env, timeout_s=timeout_s)
    finally:
        _unmount_below(dest)  # debootstrap mounts proc/sys inside; never leave them behind
    if returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:])
        reason = "timed out" if returncode is None else f"failed (exit {returncode})"
        raise RuntimeError(f"debootstrap {suite} {reason}; last lines of {log_path}:\n{tail}")
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"):
        for path in dest.glob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()
    _add_debian_user(dest)
    _write_identity_files(dest)


def debian_mirror(suite: str = "bookworm", *, apt_dir: Path = Path("/etc/apt")) -> str:
    """The host's configured Debian mirror for ``suite`` (deb822 or one-line format)."""
    for sources in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", sources.read_text(errors="replace")):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                key, sep, value = line.partition(":")
                if sep and not line.startswith(("#", " ", "\t")):
                    fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split():
                uris = fields.get("uris", "").split()
                if uris:
                    return uris[0].rstrip("/")
    for sources in [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]:
        if not sources.is_file():
            continue
        for line in sources.read_text(errors="replace").splitlines():
            tokens = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
            if len(tokens) >= 3 and tokens[0] == "deb" and tokens[2] == suite:
                return tokens[1].rstrip("/")
    return DEFAULT_DEBIAN_MIRROR


# -- ensure ----------------------------------------------------------------


def missing_base_images(store: LayerStore, names: Sequence[str] = BASE_IMAGE_NAMES) -> list[str]:
    """The names among ``names`` that ``ensure_base_images`` would build."""
    missing = []
    for name in dict.fromkeys(names):
        try:
            store.resolve(name)
        except NotFound:
            missing.append(name)
    return missing


def ensure_base_images(
    store: LayerStore,
    names: Sequence[str] = BASE_IMAGE_NAMES,
    *,
    work_dir: Path,
    progress: Progress | None = None,
) -> list[ImageRecord]:
    """Return ``name:latest`` for each name, building (once per node) what is missing."""
    report: Progress = progress or (lambda message: None)
    unknown = [name for name in names if name not in KNOWN_IMAGE_NAMES]
    if unknown:
        raise InvalidRequest(f"unknown base image(s) {', '.join(unknown)}; known: {', '.join(KNOWN_IMAGE_NAMES)}")
    records: dict[str, ImageRecord] = {}
    for name in names:
        with contextlib.suppress(NotFound):
            records[name] = store.resolve(name)
            report(f"{name}: present ({_describe(records[name])})")
    missing = [name for name in dict.fromkeys(names) if name not in records]
    if missing:
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(store.root / ".build.lock", report):
            for name in missing:
                try:
                    records[name] = store.resolve(name)
                    report(f"{name}: built by a concurrent setup ({_describe(records[name])})")
                except NotFound:
                    records[name] = _build_base_image(store, name, work_dir, report)
    return [records[name] for name in names]


def _build_base_image(store: LayerStore, name: str, work_dir: Path, report: Progress) -> ImageRecord:
    stage, build, source = _base_image_plan(name, work_dir)
    started = time.monotonic()
    rootfs = Path(tempfile.mkdtemp(prefix=f"{name}.rootfs.", dir=work_dir))
    image_file = work_dir / f"{name}.{uuid.uuid4().hex[:12]}.erofs"
    try:
        report(f"{name}: {stage}")
        build(rootfs)
        report(f"{name}: rootfs ready in {time.monotonic() - started:.1f} s; mkfs.erofs")
        mkfs_started = time.monotonic()
        build_erofs(rootfs, image_file)
        report(f"{name}: mkfs.erofs took {time.monotonic() - mkfs_started:.1f} s; importing into {store.root}")
        layer = store.import_layer(image_file, kind="base", labels={"source": source}, move=True)
        record = store.tag(name, [layer.digest])
    finally:
        image_file.unlink(missing_ok=True)
        _remove_tree(rootfs)
    report(f"{name}: built {_describe(record)} in {time.monotonic() - started:.1f} s")
    return record


def _base_image_plan(name: str, work_dir: Path) -> tuple[str, Callable[[Path], None], str]:
    """(progress message, rootfs builder, "source" label) for a base image."""
    if name == "busybox":
        version = (
            subprocess.run([str(BUSYBOX_BINARY), "--help"], capture_output=True, text=True)
            .stdout.split("\n", 1)[0]
            .replace(" multi-call binary.", "")
        )
        return "rootfs from the host's busybox-static (a second)", build_busybox_rootfs, version
    mirror = debian_mirror("bookworm")
    log_path = work_dir / f"{name}.debootstrap.log"
    packages = {"debian-12-systemd": SYSTEMD_PACKAGES, TOOLCHAIN_IMAGE: TOOLCHAIN_PACKAGES}.get(name, DEBIAN_PACKAGES)
    debootstrap = functools.partial(
        build_debian_rootfs, suite="bookworm", packages=packages, mirror=mirror, log_path=log_path
    )
    source = f"debootstrap --variant=minbase --include={','.join(packages)} bookworm {mirror}"
    if name != TOOLCHAIN_IMAGE:
        return f"debootstrap bookworm from {mirror} (about 1 minute; log {log_path})", debootstrap, source

    def build(rootfs: Path) -> None:
        debootstrap(rootfs)
        _warm_go_cache(rootfs, log_path)

    return f"debootstrap bookworm with toolchains from {mirror} (minutes; log {log_path})", build, source


def _warm_go_cache(rootfs: Path, log_path: Path) -> None:
    """Compile Go's standard library into the image's build cache (chrooted; the environment sandboxes use)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "GOCACHE": GO_CACHE_DIR, "CGO_ENABLED": "0",
           "GOFLAGS": "", "GOTOOLCHAIN": "local"}  # fmt: skip
    chroot = shutil.which("chroot", path=_SBIN_PATH) or "/usr/sbin/chroot"
    with open(log_path, "ab") as log:
        returncode = _run_process_group(
            [chroot, str(rootfs), "go", "build", "std"], log, env=env, timeout_s=_GO_WARM_TIMEOUT_S
        )
    if returncode != 0:
        raise RuntimeError(f"go build std in the toolchain image failed ({returncode}); see {log_path}")
    cache = rootfs / GO_CACHE_DIR.lstrip("/")
    os.chmod(cache, 0o777)
    for dirpath, dirnames, filenames in os.walk(cache):  # a sandbox's user (any uid) adds its own entries
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666)


def _describe(record: ImageRecord) -> str:
    return f"{record.ref} {record.layers[-1][:19]}, {record.size_bytes / 1e6:.1f} MB"


@contextlib.contextmanager
def _exclusive_lock(path: Path, report: Progress) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"waiting for another base-image build to finish (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


# -- helpers ---------------------------------------------------------------


def _run_process_group(argv: list[str], log: IO[bytes], *, env: dict[str, str], timeout_s: float) -> int | None:
    """Run ``argv`` in its own process group; None if it timed out.

    The group matters: debootstrap forks dpkg and chroot helpers that must
    die with it (SIGTERM, a grace period, then SIGKILL).
    """
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _add_debian_user(root: Path) -> None:
    """Append ``user`` to the account files directly: no chroot, no useradd."""
    passwd = (root / "etc/passwd").read_text()
    if re.search(rf"^user:|^[^:]*:[^:]*:{SANDBOX_UID}:", passwd, re.MULTILINE):
        return
    days = int(time.time() // 86400)
    entries = {
        "etc/passwd": f"user:x:{SANDBOX_UID}:{SANDBOX_UID}:user:/home/user:/bin/bash\n",
        "etc/group": f"user:x:{SANDBOX_UID}:\n",
        "etc/shadow": f"user:*:{days}:0:99999:7:::\n",
        "etc/gshadow": "user:!::\n",
    }
    for rel, line in entries.items():
        path = root / rel
        if path.exists():
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
    home = root / "home/user"
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o755)
    if (root / "etc/skel").is_dir():
        shutil.copytree(root / "etc/skel", home, symlinks=True, dirs_exist_ok=True)
    _chown_home(home)


def _chown_home(home: Path) -> None:
    if os.geteuid() != 0:
        return  # only root can give files away; unprivileged builds keep the caller's uid
    for dirpath, dirnames, filenames in os.walk(home):
        os.chown(dirpath, SANDBOX_UID, SANDBOX_UID)
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)


def _write_identity_files(root: Path) -> None:
    _write_text(root / "etc/hostname", "corral\n")
    _write_text(root / "etc/hosts", _ETC_HOSTS)
    _write_text(root / "etc/resolv.conf", "")


def _write_text(path: Path, text: str, mode: int = 0o644) -> None:
    path.unlink(missing_ok=True)  # may be a symlink into the host
    path.write_text(text, encoding="utf-8")
    os.chmod(path, mode)


def _is_static_elf(path: Path) -> bool:
    """True for an ELF64 file with no PT_INTERP (no dynamic loader needed)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if data[:5] != b"\x7fELF\x02":
        return False
    order: Literal["little", "big"] = "little" if data[5] == 1 else "big"
    phoff = int.from_bytes(data[32:40], order)
    phentsize = int.from_bytes(data[54:56], order)
    phnum = int.from_bytes(data[56:58], order)
    for index in range(phnum):
        offset = phoff + index * phentsize
        if int.from_bytes(data[offset : offset + 4], order) == 3:  # PT_INTERP
            return False
    return True


def _mounts_below(path: Path) -> list[str]:
    root = os.path.realpath(path)
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = mount_field(line.split()[4])
            if point == root or point.startswith(root + "/"):
                mounts.append(point)
    return mounts


def _unmount_below(path: Path) -> None:
    for point in sorted(set(_mounts_below(path)), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], stdin=subprocess.DEVNULL, capture_output=True)


def _remove_tree(path: Path) -> None:
    """rmtree that first detaches mounts, and refuses if any survive (host /dev, /proc)."""
    if not path.exists():
        return
    _unmount_below(path)
    if _mounts_below(path):
        raise RuntimeError(f"refusing to delete {path}: still has mounts below it")
    shutil.rmtree(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m corral.images.bases",
        description="Build Corral's base images into the node's layer store (skips those present).",
    )
    parser.add_argument("--store", type=Path, default=DEFAULT_STORE_DIR, help="layer store root")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="scratch space for rootfs trees")
    parser.add_argument(
        "names",
        nargs="*",
        help=f"images to ensure, of {' '.join(KNOWN_IMAGE_NAMES)} (default: {' '.join(BASE_IMAGE_NAMES)})",
    )
    parser.add_argument(
        "--check", action="store_true", help=f"build nothing; say what is missing (exit {CHECK_HAS_WORK} if any)"
    )
    args = parser.parse_args(argv)
    names = args.names or list(BASE_IMAGE_NAMES)
    if args.check:
        missing = missing_base_images(LayerStore(args.store, inspect_only=True), names)
        if missing:
            print(f"setup: would build base images into {args.store}: {' '.join(missing)}", flush=True)
        return CHECK_HAS_WORK if missing else 0
    try:
        ensure_base_images(
            LayerStore(args.store),
            names,
            work_dir=args.work_dir,
            progress=lambda message: print(f"images: {message}", flush=True),
        )
    except (CorralError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"images: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
