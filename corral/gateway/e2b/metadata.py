"""File metadata (envd 0.6.2): ``X-Metadata-<key>`` upload headers kept as ``user.<key>`` extended attributes.

Corral's file API has no xattr calls, so a small Python program run inside
the sandbox sets and reads them (the image needs ``python3``; ``base`` has
it). Reading costs one command per ``Stat``/``ListDir``, so it is done only
in sandboxes the facade has written metadata to; xattrs that processes in
the sandbox set themselves show up there too, but not in a sandbox the
facade never wrote metadata to. Keys are lowercased, as envd does.
"""

from __future__ import annotations

import json
from typing import Any

from corral.api.errors import InvalidRequest
from corral.api.models import ExecRequest
from corral.gateway.service import SandboxService

__all__ = ["METADATA_HEADER_PREFIX", "FileMetadata"]

METADATA_HEADER_PREFIX = "x-metadata-"
_XATTR_PREFIX = "user."
_TIMEOUT_S = 30
_PROGRAM = """
import json, os, sys
action, argument = sys.argv[1], json.loads(sys.argv[2])
if action == "set":
    for path in argument["paths"]:
        for key, value in argument["metadata"].items():
            os.setxattr(path, "user." + key, value.encode(), follow_symlinks=False)
else:
    found = {}
    for path in argument:
        try:
            names = [n for n in os.listxattr(path, follow_symlinks=False) if n.startswith("user.")]
            found[path] = {n[5:]: os.getxattr(path, n, follow_symlinks=False).decode("utf-8", "replace") for n in names}
        except OSError:
            pass
    print(json.dumps(found))
"""


class FileMetadata:
    """Sets metadata on written files and reads it back for entries, per sandbox."""

    def __init__(self, sandboxes: SandboxService) -> None:
        self._sandboxes = sandboxes
        self._written: set[str] = set()  # sandboxes with metadata written through the facade

    @staticmethod
    def from_headers(headers: Any) -> dict[str, str]:
        return {
            name[len(METADATA_HEADER_PREFIX) :].lower(): value
            for name, value in headers.items()
            if name.lower().startswith(METADATA_HEADER_PREFIX) and len(name) > len(METADATA_HEADER_PREFIX)
        }

    async def _run(self, sandbox_id: str, action: str, argument: Any) -> str:
        request = ExecRequest(
            cmd=["python3", "-c", _PROGRAM, action, json.dumps(argument)], user="root", cwd="/", timeout_s=_TIMEOUT_S
        )
        result = await self._sandboxes.call(sandbox_id, lambda edge: edge.exec(sandbox_id, request))
        if result.exit_code != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise InvalidRequest(
                f"file metadata needs python3 and xattrs in the sandbox: {detail[-1] if detail else result.exit_code}"
            )
        return result.stdout

    async def write(self, sandbox_id: str, paths: list[str], metadata: dict[str, str]) -> None:
        if not metadata or not paths:
            return
        self._written.add(sandbox_id)
        await self._run(sandbox_id, "set", {"paths": paths, "metadata": metadata})

    async def annotate(self, sandbox_id: str, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add ``metadata`` to envd EntryInfo dicts (by their ``path``) that have any."""
        if sandbox_id not in self._written or not entries:
            return entries
        found = json.loads(await self._run(sandbox_id, "get", [e["path"] for e in entries]) or "{}")
        for item in entries:
            if found.get(item["path"]):
                item["metadata"] = found[item["path"]]
        return entries

    def forget(self, sandbox_id: str) -> None:
        self._written.discard(sandbox_id)
