"""The OCI runtime runs from a sealed in-memory copy of its binary (corral/backends/container/runtime.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from corral.backends.container.runtime import OciRuntime


def test_crun_runs_from_a_sealed_copy_nobody_can_write(tmp_path: Path) -> None:
    runtime = OciRuntime("crun", tmp_path / "state", Path("/nonexistent"))
    try:
        binary = runtime._base()[0]
        fd = int(binary.rsplit("/", 1)[1])
        assert binary == f"/proc/self/fd/{fd}" and fd >= 64  # never fd 3, the agent's socket in a container
        assert os.readlink(binary).startswith("/memfd:corral-crun")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SEAL  # crun then skips its own copy
        assert Path(binary).read_bytes() == Path(shutil.which("crun") or "").read_bytes()
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        version = subprocess.run([binary, "--version"], pass_fds=(fd,), capture_output=True, text=True, check=True)
        assert version.stdout.startswith("crun version")
        assert not os.get_inheritable(fd)  # passed to the runtime's own processes only
    finally:
        runtime.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert runtime._base()[0] == shutil.which("crun")  # a late call (a teardown after close) still finds crun


def test_other_runtimes_run_from_their_path(tmp_path: Path) -> None:
    """runc (1.1 here) decides on its copy by other means: it runs as installed."""
    runtime = OciRuntime("runc", tmp_path / "state", Path("/nonexistent"))
    assert runtime._base()[0] == shutil.which("runc")
    runtime.close()
