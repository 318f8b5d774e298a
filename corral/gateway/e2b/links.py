"""Symlinks as envd reports them: the target resolved to an absolute path, and what is there.

envd answers ``Stat`` and ``ListDir`` for a symlink with the target's type and
permission bits, ``symlinkTarget`` set to the fully resolved absolute path
(Go's ``filepath.EvalSymlinks``: every link on the way followed, ``..`` taken
after the link before it) and ``isSymlink`` marking the link itself; a link that
dangles or loops has no type and its own path as target. ``ListDir`` of a link
to a directory lists the directory, under the path as asked.

Corral's file API stats a path without following its last component (and
confines every lookup to the sandbox's root), so resolution is done here, one
component at a time, with one ``stat`` per component; answers are cached for
the request, so a listing full of links into one tree stats each directory once.
"""

from __future__ import annotations

import posixpath
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from corral.api.errors import InvalidRequest, NotFound
from corral.api.models import FileInfo

__all__ = ["MAX_LINK_HOPS", "Link", "LinkLoop", "Resolver"]

MAX_LINK_HOPS = 255  # Go's filepath.EvalSymlinks gives up after 255 links


class LinkLoop(InvalidRequest):
    """More than ``MAX_LINK_HOPS`` links on the way: a cycle, as envd says."""


@dataclass(frozen=True)
class Link:
    """Where a symlink leads: the resolved absolute path, and what is there (None when it dangles or loops)."""

    target: str
    info: FileInfo | None


class Resolver:
    """Resolves paths inside one sandbox for one request, with ``stat`` (which does not follow a final link)."""

    def __init__(self, stat: Callable[[str], Awaitable[FileInfo]]) -> None:
        self._stat = stat
        self._seen: dict[str, FileInfo] = {}

    async def stat(self, path: str) -> FileInfo:
        if path not in self._seen:
            self._seen[path] = await self._stat(path)
        return self._seen[path]

    async def resolve(self, path: str) -> tuple[str, FileInfo]:
        """The absolute path with no symlink in it, and its entry; NotFound when a component is missing."""
        pending = list(reversed(path.split("/")))
        resolved, info, hops = "/", None, 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                resolved, info = posixpath.dirname(resolved), None
                continue
            candidate = posixpath.join(resolved, part)
            found = await self.stat(candidate)
            if found.type != "symlink":
                resolved, info = candidate, found
                continue
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise LinkLoop(f"cyclic symlink or chain >{MAX_LINK_HOPS} links at {path!r}")
            target = found.link_target or ""
            if target.startswith("/"):
                resolved = "/"
            pending.extend(reversed(target.split("/")))
        return resolved, info or await self.stat(resolved)

    async def follow(self, link: FileInfo) -> Link:
        """Where the symlink ``link`` leads; a dangling or looping one leads to itself, with nothing there."""
        try:
            target, info = await self.resolve(link.path)
        except (NotFound, LinkLoop):
            return Link(link.path, None)
        return Link(target, info)
