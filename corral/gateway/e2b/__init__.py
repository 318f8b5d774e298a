"""An E2B-compatible facade: the unmodified ``e2b`` and ``e2b-code-interpreter`` SDKs drive Corral sandboxes.

Served on Corral's own port, next to /v1, over the same SandboxService,
operations layer (trajectory log and audit): ``control`` is E2B's REST API (create, connect,
list, pause, timeout, kill, metrics), ``lifecycle`` its snapshots, forks
and pausing at the timeout (autoPause), ``envd`` the in-sandbox daemon's
protocol (processes, filesystem, /files), routed by the ``E2b-Sandbox-Id``
and ``E2b-Sandbox-Port`` headers, ``interpreter`` the code interpreter's
port 49999 (``run_code`` and contexts) backed by a small Python kernel
shipped into the sandbox. ``processes``, ``pty`` and ``watch`` stand in for
what E2B keeps inside envd (running processes, terminals, directory
watchers); ``metrics`` samples a sandbox; ``template`` builds ``e2b-base``; ``builds``
maps E2B's template build API onto Dockerfile builds. docs/e2b.md says what is and is not supported.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from corral.api.models import SandboxInfo
from corral.gateway.e2b import builds, control, envd, interpreter, lifecycle
from corral.gateway.e2b.common import e2b_api_key, quiet_aborted_streams
from corral.gateway.e2b.metadata import FileMetadata
from corral.gateway.e2b.metrics import sample
from corral.gateway.e2b.network import InternetEgress
from corral.gateway.e2b.processes import ProcessTable
from corral.gateway.e2b.watch import Watchers

__all__ = ["E2BFacade", "e2b_api_key", "include_e2b"]


class E2BFacade:
    """What the facade keeps between requests; owned by the app's lifespan, which closes it."""

    def __init__(self, services: Any, max_file_bytes: int, internet_egress: InternetEgress) -> None:
        self.server_key: str = services.tokens.server_key
        self.max_file_bytes = max_file_bytes
        self.internet_egress = internet_egress
        self._sandboxes = services.sandboxes
        self._operations = services.operations
        self.processes = ProcessTable(services.operations)
        self.watchers = Watchers(services.sandboxes, envd.entry)
        self.metadata = FileMetadata(services.sandboxes)
        self.kernels = interpreter.Kernels(self.processes, services.operations)
        self._killing: set[str] = set()
        self._pauser: asyncio.Task[None] | None = None
        self.timeouts = lifecycle.TimeoutPauser(services.sandboxes, services.operations)
        self._scratch = contextlib.ExitStack()  # the template builds' files, removed at close
        self.templates = builds.TemplateBuilds(
            lambda: self._scratch.enter_context(services.images.scratch("e2b-templates-"))
        )

    def start(self) -> None:
        """Start pausing ``autoPause`` sandboxes at their timeout (until ``close``)."""
        self._pauser = asyncio.get_running_loop().create_task(self.timeouts.run())

    async def metrics(self, info: SandboxInfo) -> dict[str, Any]:
        return await sample(self._sandboxes, info)

    async def kill(self, sandbox_id: str) -> None:
        """Kill it and drop its processes, kernels and watchers. It counts as gone from the start, so the
        streams the kill breaks are dropped (not ended with an error) and ``/health`` already says 502."""
        self._killing.add(sandbox_id)
        self.processes.stopping(sandbox_id)
        try:
            await self._operations.kill(sandbox_id)
        finally:
            self.kernels.forget(sandbox_id)
            self.watchers.forget(sandbox_id)
            self.metadata.forget(sandbox_id)
            await self.processes.forget(sandbox_id)
            self._killing.discard(sandbox_id)

    def killing(self, sandbox_id: str) -> bool:
        return sandbox_id in self._killing

    async def close(self) -> None:
        if self._pauser is not None:
            self._pauser.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pauser
        await self.processes.close()
        await self.templates.close()
        self._scratch.close()


def include_e2b(app: FastAPI, max_file_bytes: int, internet_egress: InternetEgress = "public") -> None:
    """Serve the E2B API on ``app``; the facade lives as long as the app's services."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with inner(app) as state:
            app.state.e2b = E2BFacade(app.state.service, max_file_bytes, internet_egress)
            app.state.e2b.start()
            try:
                yield state
            finally:
                await app.state.e2b.close()

    app.router.lifespan_context = lifespan
    quiet_aborted_streams()
    app.include_router(control.router)
    app.include_router(lifecycle.router)
    app.include_router(builds.router)
    app.include_router(envd.router)
    app.include_router(interpreter.router)
