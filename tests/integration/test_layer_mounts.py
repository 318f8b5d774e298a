"""Layer mounts where the kernel cannot back EROFS by the file: the error says what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from corral.config import Settings
from corral.images.store import LayerStore
from tests.conftest import REPO


def test_a_layer_on_tmpfs_fails_with_what_to_do(tmp_path: Path) -> None:
    """EROFS mounts a file only from filesystems that can back it; on tmpfs the kernel says ENOTBLK, and the
    error must say to keep the node dir on a disk filesystem (found on a machine whose /tmp is a tmpfs)."""
    store = LayerStore(Settings().layer_dir, inspect_only=True)
    layer = store.layer_path(store.resolve("busybox").layers[0])
    script = (
        "import sys, shutil, pathlib, subprocess\n"
        "from corral.backends.common.host import _mount_erofs\n"
        "scratch = pathlib.Path(sys.argv[1])\n"
        "subprocess.run(['mount', '-t', 'tmpfs', 'tmpfs', str(scratch)], check=True)\n"
        "shutil.copy(sys.argv[2], scratch / 'layer.erofs'); (scratch / 'mnt').mkdir()\n"
        "try:\n"
        "    _mount_erofs(scratch / 'layer.erofs', scratch / 'mnt')\n"
        "except OSError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script, str(tmp_path), str(layer)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Block device required: EROFS cannot mount" in done.stdout
    assert "keep the node dir (CORRAL_NODE_DIR) and the data dir on a disk filesystem" in done.stdout
