"""scripts/setup.sh on machines that lack what it installs, and where a step cannot succeed.

The tools are hidden the way a fresh machine lacks them: in a private mount namespace (gone when the
shell exits, so nothing needs undoing), an empty file or a failing script is bind-mounted over each
binary and a copy of dpkg's status file without their packages over /var/lib/dpkg/status. The script
then has to say what it would install instead of dying on its first probe (issue 15: a `$(runsc
--version | sed)` under `set -euo pipefail` exited 127 before the branch that installs runsc).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO

SETUP = REPO / "scripts" / "setup.sh"
# command -> the Debian package that provides it (as in setup.sh's APT_PACKAGES, runsc from backports)
HIDDEN = {
    "crun": "crun",
    "runc": "runc",
    "mkfs.erofs": "erofs-utils",
    "debootstrap": "debootstrap",
    "qemu-system-x86_64": "qemu-system-x86",
    "busybox": "busybox-static",
    "runsc": "runsc",
}
# Hidden by a script that fails the way a broken install does, rather than by an empty file.
BROKEN = {"runsc"}


def _without_packages(status: str, packages: set[str]) -> str:
    hidden = {f"Package: {package}" for package in packages}
    return "\n\n".join(s for s in status.split("\n\n") if hidden.isdisjoint(s.splitlines()))


@pytest.fixture
def hiding(tmp_path: Path) -> Path:
    """A directory for the files that stand in for hidden ones."""
    directory = tmp_path / "hidden"
    directory.mkdir()
    return directory


def _run_hidden(
    hiding: Path,
    *,
    commands: Sequence[str] = (),
    overlays: dict[str, Path] | None = None,
    args: Sequence[str] = ("--check",),
    env: dict[str, str] | None = None,
    network: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run setup.sh in a private mount namespace where ``commands`` (and their packages) are gone and each
    ``overlays`` target path shows the given file instead."""
    empty = hiding / "empty"
    empty.write_text("")
    empty.chmod(0o644)
    failing = hiding / "failing"
    failing.write_text("#!/bin/sh\necho 'error while loading shared libraries' >&2\nexit 127\n")
    failing.chmod(0o755)
    binds: list[tuple[Path, str]] = []
    for command in commands:
        found = shutil.which(command)
        assert found, f"{command} is not installed here, so hiding it tests nothing"
        binds.append((failing if command in BROKEN else empty, os.path.realpath(found)))
    packages = {HIDDEN[c] for c in commands}
    if packages:
        status = hiding / "status"
        status.write_text(_without_packages(Path("/var/lib/dpkg/status").read_text(), packages))
        binds.append((status, "/var/lib/dpkg/status"))
    binds.extend((source, target) for target, source in (overlays or {}).items())
    if not network:  # no name server either, so lookups fail at once instead of after the resolver's timeouts
        binds.append((empty, "/etc/resolv.conf"))
    mounts = "".join(f"mount --bind {source} {target} && " for source, target in binds)
    unshare = ["unshare", "--mount", "--propagation", "private", *([] if network else ["--net"])]
    return subprocess.run(
        [*unshare, "bash", "-c", f'{mounts}exec bash "$0" "$@"', str(SETUP), *args],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _plan(run: subprocess.CompletedProcess[str]) -> list[str]:
    assert run.returncode == 0, f"setup.sh --check died ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return [line.removeprefix("setup: would ") for line in run.stdout.splitlines() if line.startswith("setup: would ")]


def test_check_with_tools_and_images_missing_says_what_it_would_install(hiding: Path, tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    run = _run_hidden(hiding, commands=list(HIDDEN), env={"CORRAL_NODE_DIR": str(node_dir)})
    plan = _plan(run)
    apt = next(line for line in plan if line.startswith("install apt packages: "))
    assert apt.split(": ", 1)[1].split() == [
        "erofs-utils", "crun", "runc", "busybox-static", "debootstrap", "qemu-system-x86"
    ]  # fmt: skip
    assert "install runsc from bookworm-backports (have: none)" in plan
    assert f"build base images into {node_dir}/layers: busybox debian-12 debian-12-systemd" in plan
    assert f"build base images into {node_dir}/layers: debian-12-toolchains" in plan  # the SandboxFusion compilers
    assert any(line.startswith("build the E2B template e2b-base") for line in plan)
    assert "compile corral-agent and corral-launch" in plan
    assert run.stdout.rstrip().endswith(f"setup: {len(plan)} step(s) would run; scripts/setup.sh does them")
    assert run.stderr == ""
    assert list(node_dir.iterdir()) == [], "--check built something"


def test_check_without_the_virtualenv_says_it_would_create_it(hiding: Path, tmp_path: Path) -> None:
    no_venv = hiding / "venv"
    no_venv.mkdir()
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    run = _run_hidden(hiding, commands=["runsc"], overlays={str(REPO / ".venv"): no_venv},
                      env={"CORRAL_NODE_DIR": str(node_dir)})  # fmt: skip
    plan = _plan(run)
    assert plan[0].startswith(f"create the virtualenv {REPO}/.venv (Python 3.")
    assert "install runsc from bookworm-backports (have: none)" in plan
    assert f"build the base images and the VM guest kit that {node_dir} lacks" in "\n".join(plan)
    assert list(no_venv.iterdir()) == [] and list(node_dir.iterdir()) == []


def test_check_on_this_set_up_machine_has_nothing_to_install() -> None:
    """make test ran setup.sh first: a second run must be a no-op."""
    run = subprocess.run(["bash", str(SETUP), "--check"], capture_output=True, text=True, timeout=120)
    assert _plan(run) == []
    assert run.stdout.splitlines()[-1] == "setup: nothing to install"


def _one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 1, f"expected a failure, got {run.returncode}:\n{run.stdout}\n{run.stderr}"
    lines = run.stderr.splitlines()
    assert len(lines) == 1, f"more than the one line:\n{run.stderr}"
    assert lines[0].startswith("setup: error: ")
    return lines[0].removeprefix("setup: error: ")


def test_not_root_is_one_line_naming_the_step() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="corral-setup-"))
    try:
        scratch.chmod(0o755)
        (scratch / "scripts").mkdir(mode=0o755)
        script = scratch / "scripts" / "setup.sh"
        shutil.copy(SETUP, script)
        script.chmod(0o755)
        run = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(script)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch)
    assert _one_error_line(run).startswith("root: run as root")


@pytest.mark.parametrize("mode", [("--check",), ()], ids=["check", "install"])
def test_a_kernel_without_erofs_is_one_line_naming_the_step(hiding: Path, tmp_path: Path, mode: tuple[str]) -> None:
    filesystems = hiding / "filesystems"
    filesystems.write_text("".join(line for line in Path("/proc/filesystems").read_text().splitlines(keepends=True)
                                   if line.split()[-1] != "erofs"))  # fmt: skip
    no_module = hiding / "modprobe"
    no_module.write_text("#!/bin/sh\necho 'modprobe: FATAL: Module erofs not found' >&2\nexit 1\n")
    no_module.chmod(0o755)
    modprobe = shutil.which("modprobe")
    assert modprobe
    run = _run_hidden(hiding, overlays={"/proc/filesystems": filesystems, os.path.realpath(modprobe): no_module},
                      args=mode, env={"CORRAL_SETUP_LOG": str(tmp_path / "setup.log")})  # fmt: skip
    line = _one_error_line(run)
    assert line.startswith("kernel: this kernel has no erofs filesystem"), line
    assert "Linux 5.15+ with EROFS and overlayfs" in line


def test_no_route_to_the_package_mirror_is_one_line_naming_the_step(hiding: Path, tmp_path: Path) -> None:
    """crun is missing and the machine has no network (a network namespace with only loopback): apt-get
    update cannot reach the mirror. apt's lists and cache are bind-mounted from scratch, so the host's
    stay as they were."""
    lists, cache = hiding / "lists", hiding / "cache"
    (lists / "partial").mkdir(parents=True)
    (cache / "archives" / "partial").mkdir(parents=True)
    run = _run_hidden(hiding, commands=["crun"], args=(), network=False,
                      overlays={"/var/lib/apt/lists": lists, "/var/cache/apt": cache},
                      env={"CORRAL_SETUP_LOG": str(tmp_path / "setup.log")})  # fmt: skip
    line = _one_error_line(run)
    assert line.startswith("apt-get update: cannot reach the package mirror (E: Failed to fetch http"), line
    assert "check the network, a proxy or /etc/apt/sources.list*" in line
    assert "setup: install apt packages: crun" in run.stdout


def test_no_route_to_pypi_is_one_line_naming_the_step(hiding: Path, tmp_path: Path) -> None:
    """No virtualenv and no network: creating the venv works offline, installing into it cannot."""
    no_venv = hiding / "venv"
    no_venv.mkdir()
    run = _run_hidden(hiding, args=(), network=False, overlays={str(REPO / ".venv"): no_venv},
                      env={"CORRAL_SETUP_LOG": str(tmp_path / "setup.log"), "PIP_RETRIES": "0",
                           "PIP_DEFAULT_TIMEOUT": "5"})  # fmt: skip
    line = _one_error_line(run)
    assert line.startswith("virtualenv: pip install failed (ERROR: "), line
    assert "is PyPI reachable?" in line
    assert "setup: create the virtualenv" in run.stdout
