"""Named checkpoints kept beside a sandbox (VMs and gVisor): one directory each, with a checkpoint.json.

The backends write a checkpoint's files their own way (QEMU migration, runsc checkpoint); naming,
recording, listing and finding them is the same for both, here.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from corral.api.errors import NotFound

__all__ = ["find_checkpoint", "list_checkpoints", "save_checkpoint"]

_META = "checkpoint.json"


async def save_checkpoint(
    directory: Path, sandbox_id: str, write: Callable[[Path], Awaitable[None]]
) -> dict[str, object]:
    """Make a new checkpoint under ``directory`` with ``write(dest)``, record it, and describe it."""
    checkpoint_id = f"ck-{secrets.token_hex(6)}"
    dest = directory / checkpoint_id
    try:
        await write(dest)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, dest, True)
        raise
    size = sum(p.stat().st_blocks * 512 for p in dest.rglob("*") if not p.is_symlink())
    info: dict[str, object] = {"id": checkpoint_id, "sandbox_id": sandbox_id, "created_at": time.time(),
                               "size_bytes": size}  # fmt: skip
    (dest / _META).write_text(json.dumps(info))
    return info


def list_checkpoints(directory: Path) -> list[dict[str, object]]:
    """The recorded checkpoints under ``directory``, oldest first."""
    found = []
    for meta in directory.glob(f"*/{_META}"):
        try:
            found.append(json.loads(meta.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda info: float(info["created_at"]))


def find_checkpoint(directory: Path, sandbox_id: str, checkpoint_id: str) -> Path:
    path = directory / checkpoint_id
    if "/" in checkpoint_id or not (path / _META).exists():
        raise NotFound(f"sandbox {sandbox_id} has no checkpoint {checkpoint_id!r} (see GET .../checkpoints)")
    return path
