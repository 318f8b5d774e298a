"""What differs between the e2b SDK versions these tests run under (the venv's, and 2.45 in test_e2b_2_45.py).

The facade answers every version alike; the SDKs show some answers differently.
"""

from __future__ import annotations

import importlib.metadata

import e2b
from packaging.version import Version

__all__ = ["E2B_VERSION", "FILESYSTEM_ONLY", "HAS_SNAPSHOT_MODES", "SandboxGoneError", "SHOWS_SYMLINKS"]

E2B_VERSION = Version(importlib.metadata.version("e2b"))
# A sandbox that is gone: e2b 2.4x raises TimeoutException ("... was killed ..."), later ones its subclass.
SandboxGoneError: type[Exception] = getattr(e2b, "SandboxNotRunningException", e2b.TimeoutException)
# envd's isSymlink: e2b 2.6x shows a link as FileType.SYMLINK; older SDKs show the target's type.
SHOWS_SYMLINKS = "is_symlink" in e2b.envd.filesystem.filesystem_pb.EntryInfo.__slots__
# ``mode="full" | "filesystem"`` (pause, create_snapshot, lifecycle) and ``connect(on_resume=)`` came after 2.45,
# which has ``keep_memory`` (pause, lifecycle) instead and no choice for snapshots.
HAS_SNAPSHOT_MODES = hasattr(e2b.sandbox.sandbox_api, "resolve_snapshot_memory")
FILESYSTEM_ONLY = {"mode": "filesystem"} if HAS_SNAPSHOT_MODES else {"keep_memory": False}
