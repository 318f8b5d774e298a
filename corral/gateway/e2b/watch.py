"""Directory watches for E2B's ``watch_dir``, by comparing listings (Corral has no inotify channel).

The sync SDK polls (``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher``);
the async SDK streams ``WatchDir``. Both compare the directory's listing
with the previous one: new entries are CREATE, vanished ones REMOVE, a
changed size or mtime WRITE, a changed mode CHMOD. Changes that cancel out
between two looks (a file created and removed) are not seen, and a rename
is a REMOVE plus a CREATE. With ``include_entry`` (envd 0.6.3) each event but
a REMOVE carries the entry as the listing saw it. ``allow_network_mounts``
(0.6.4) changes nothing: comparing listings works on any filesystem.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from corral.api.errors import CorralError, InvalidRequest, NotFound
from corral.api.models import FileInfo
from corral.gateway.e2b.common import END_STREAM, Target, frame
from corral.gateway.service import SandboxService

__all__ = ["Watchers", "POLL_INTERVAL_S"]

POLL_INTERVAL_S = 0.2
_MAX_WATCHERS_PER_SANDBOX = 64
_Snapshot = dict[str, FileInfo]


@dataclass
class _Watcher:
    sandbox_id: str
    path: str
    recursive: bool
    snapshot: _Snapshot
    include_entry: bool = False


class Watchers:
    def __init__(self, sandboxes: SandboxService, entry: Callable[[FileInfo], dict[str, Any]]) -> None:
        self._sandboxes = sandboxes
        self._entry = entry  # a FileInfo as envd's EntryInfo (envd.py)
        self._watchers: dict[tuple[str, str], _Watcher] = {}

    async def _scan(self, sandbox_id: str, path: str, recursive: bool) -> _Snapshot:
        snapshot: _Snapshot = {}
        pending = [path]
        while pending:
            directory = pending.pop()
            try:
                infos = await self._sandboxes.call(
                    sandbox_id,
                    lambda edge: edge.list_dir(sandbox_id, directory),  # noqa: B023 - awaited here
                )
            except NotFound:
                if directory == path:
                    raise
                continue  # a subdirectory removed while we looked
            for info in infos:
                snapshot[info.path] = info
                if recursive and info.type == "dir":
                    pending.append(info.path)
        return snapshot

    async def create(self, where: Target, path: str, recursive: bool, include_entry: bool = False) -> str:
        if sum(sid == where.sandbox_id for sid, _ in self._watchers) >= _MAX_WATCHERS_PER_SANDBOX:
            raise InvalidRequest(
                f"too many watchers in sandbox {where.sandbox_id} (at most {_MAX_WATCHERS_PER_SANDBOX})"
            )
        info = await self._sandboxes.call(where.sandbox_id, lambda edge: edge.stat(where.sandbox_id, path))
        if info.type != "dir":
            raise InvalidRequest(f"path {path} is not a directory")
        watcher_id = secrets.token_hex(8)
        snapshot = await self._scan(where.sandbox_id, path, recursive)
        self._watchers[(where.sandbox_id, watcher_id)] = _Watcher(
            where.sandbox_id, path, recursive, snapshot, include_entry
        )
        return watcher_id

    def _get(self, sandbox_id: str, watcher_id: str) -> _Watcher:
        watcher = self._watchers.get((sandbox_id, watcher_id))
        if watcher is None:
            raise NotFound(f"watcher {watcher_id} not found")
        return watcher

    async def events(self, sandbox_id: str, watcher_id: str) -> list[dict[str, Any]]:
        """What changed since the last look, as proto3-JSON FilesystemEvents."""
        watcher = self._get(sandbox_id, watcher_id)
        current = await self._scan(sandbox_id, watcher.path, watcher.recursive)
        before, watcher.snapshot = watcher.snapshot, current
        events = []
        prefix = watcher.path.rstrip("/") + "/"
        for path in sorted(before.keys() | current.keys()):
            old, new = before.get(path), current.get(path)
            old_key, new_key = (None if i is None else (i.type, i.size, i.mtime, i.mode) for i in (old, new))
            if old_key == new_key:
                continue
            if old_key is None:
                kind = "EVENT_TYPE_CREATE"
            elif new_key is None:
                kind = "EVENT_TYPE_REMOVE"
            elif old_key[:3] != new_key[:3]:
                kind = "EVENT_TYPE_WRITE"
            else:
                kind = "EVENT_TYPE_CHMOD"
            event: dict[str, Any] = {"name": path.removeprefix(prefix), "type": kind}
            if watcher.include_entry and new is not None:
                event["entry"] = self._entry(new)
            events.append(event)
        return events

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        self._get(sandbox_id, watcher_id)
        del self._watchers[(sandbox_id, watcher_id)]

    def forget(self, sandbox_id: str) -> None:
        for key in [key for key in self._watchers if key[0] == sandbox_id]:
            del self._watchers[key]

    async def stream(
        self, sandbox_id: str, watcher_id: str, deadline_s: float | None, keepalive_s: float
    ) -> AsyncIterator[bytes]:
        """WatchDir frames: start, then events as they are seen, keepalives; ends at the deadline."""
        stop_at = time.monotonic() + deadline_s if deadline_s else None
        last_sent = time.monotonic()
        try:
            yield frame({"start": {}})
            while stop_at is None or time.monotonic() < stop_at:
                await asyncio.sleep(POLL_INTERVAL_S)
                try:
                    events = await self.events(sandbox_id, watcher_id)
                except CorralError as exc:
                    yield frame({"error": {"code": "not_found", "message": exc.message}}, END_STREAM)
                    return
                for event in events:
                    yield frame({"filesystem": event})
                    last_sent = time.monotonic()
                if time.monotonic() - last_sent >= keepalive_s:
                    yield frame({"keepalive": {}})
                    last_sent = time.monotonic()
            yield frame(
                {"error": {"code": "deadline_exceeded", "message": f"the watch's deadline of {deadline_s:g} s passed"}},
                END_STREAM,
            )
        finally:
            self._watchers.pop((sandbox_id, watcher_id), None)
