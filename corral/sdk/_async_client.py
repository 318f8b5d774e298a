"""The asynchronous SDK. Hand-written; _sync_client.py is generated from it
by scripts/unasync.py (run it after editing; a test checks they agree).

``AsyncSandbox`` is plain data (id, URL, API key, info): it pickles, crosses
Ray and survives a trainer restart; the HTTP connection is re-created lazily.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from corral.api.errors import CorralError, InvalidRequest, ServerUnavailable, error_from_response
from corral.api.models import (
    DEFAULT_CPU,
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_MEMORY_MB,
    DEFAULT_OUTPUT_CAP_BYTES,
    DEFAULT_PIDS_MAX,
    DEFAULT_QOS,
    DEFAULT_TTL_S,
    AuditEvent,
    BatchCreateRequest,
    BatchEvent,
    BuildEvent,
    BuildRequest,
    BulkRequest,
    BulkResult,
    CheckpointInfo,
    ClusterNode,
    CommandInfo,
    CreateSandboxRequest,
    Environment,
    Event,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    FnCallBatch,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    GradeRequest,
    GradeResult,
    ImageDetail,
    ImageInfo,
    LayerInfo,
    MkdirRequest,
    NetworkPolicy,
    NetworkRule,
    NetworkStatus,
    NodeStats,
    PauseResult,
    PoolStats,
    PtySize,
    PullEvent,
    PullRequest,
    RenameRequest,
    ReplayRequest,
    ReplayResult,
    RunCodeRequest,
    RunCodeResult,
    SandboxInfo,
    SnapshotInfo,
    TagRequest,
    TrajectoryStep,
    is_registry_reference,
)
from corral.sdk._config import resolve_connection
from corral.sdk._transport import AsyncTransport

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncFiles", "AsyncImages"]

DEFAULT_TIMEOUT_S = 60.0
VM_CREATE_TIMEOUT_S = 600.0
BATCH_TIMEOUT_S = 3600.0  # a batch stream may go quiet while its creates run (a progress line per 1,000)
EVENTS_QUIET_S = 30.0  # a followed event stream sends a blank line every 15 s of quiet
PULL_TIMEOUT_S = 3600.0  # a create from a registry image not pulled yet waits for the pull (GBs)
M = TypeVar("M", bound=BaseModel)


def _validated(model: type[M], fields: dict[str, Any]) -> M:
    """Check arguments before sending, with the same errors the server gives."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequest(f"invalid request: {problems}") from None


def _step(step_id: str | None) -> dict[str, str]:
    """The query parameter of a logged file operation's client step id, when it has one."""
    return {"step_id": step_id} if step_id else {}


def _exec_body(
    cmd: str | list[str],
    env: dict[str, str] | None,
    cwd: str | None,
    user: str | None,
    timeout_s: float,
    stdin: str | None,
    output_cap_bytes: int,
    step_id: str | None,
    pty: tuple[int, int] | None = None,
) -> dict[str, Any]:
    fields: dict[str, Any] = {"cmd": cmd, "env": env or {}, "cwd": cwd, "user": user, "timeout_s": timeout_s,
                              "stdin": stdin, "output_cap_bytes": output_cap_bytes, "step_id": step_id}  # fmt: skip
    if pty is not None:  # only when asked: servers before terminals refuse the field
        fields["pty"] = {"rows": pty[0], "cols": pty[1]}
    body = _validated(ExecRequest, fields).model_dump(mode="json")
    if pty is None:
        del body["pty"]
    return body


class AsyncFiles:
    """``sandbox.files``: file operations confined to the sandbox's root."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _path(self, suffix: str) -> str:
        return f"/v1/sandboxes/{self._sandbox.id}/files{suffix}"

    async def read(self, path: str) -> bytes:
        response = await self._sandbox._transport.request("GET", self._path("/content"), params={"path": path})
        return response.content

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644, step_id: str | None = None) -> FileInfo:
        """Write a file (replaced atomically); ``step_id`` makes a resend answer from the trajectory log."""
        content = data.encode() if isinstance(data, str) else data
        params: dict[str, Any] = {"path": path, "mode": mode, **_step(step_id)}
        response = await self._sandbox._transport.request("PUT", self._path("/content"), params=params, content=content)
        return FileInfo.model_validate(response.json())

    async def stat(self, path: str) -> FileInfo:
        response = await self._sandbox._transport.request("GET", self._path("/stat"), params={"path": path})
        return FileInfo.model_validate(response.json())

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except CorralError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def list(self, path: str) -> list[FileInfo]:
        response = await self._sandbox._transport.request("GET", self._path("/list"), params={"path": path})
        return [FileInfo.model_validate(item) for item in response.json()]

    async def mkdir(
        self, path: str, *, parents: bool = True, mode: int = 0o755, step_id: str | None = None
    ) -> FileInfo:
        body = _validated(MkdirRequest, {"path": path, "parents": parents, "mode": mode}).model_dump()
        response = await self._sandbox._transport.request(
            "POST", self._path("/mkdir"), json=body, params=_step(step_id)
        )
        return FileInfo.model_validate(response.json())

    async def remove(self, path: str, *, recursive: bool = False, step_id: str | None = None) -> None:
        params = {"path": path, "recursive": str(recursive).lower(), **_step(step_id)}
        await self._sandbox._transport.request("DELETE", self._path(""), params=params)

    async def rename(self, source: str, dest: str, *, step_id: str | None = None) -> FileInfo:
        """Move ``source`` to ``dest`` (rename(2): parents made; a file there is replaced, a directory refused)."""
        body = _validated(RenameRequest, {"source": source, "dest": dest}).model_dump()
        response = await self._sandbox._transport.request(
            "POST", self._path("/rename"), json=body, params=_step(step_id)
        )
        return FileInfo.model_validate(response.json())

    async def upload_tar(self, path: str, tar_bytes: bytes, *, step_id: str | None = None) -> int:
        """Extract a tar archive (plain or compressed) into directory ``path``; returns the member count."""
        response = await self._sandbox._transport.request(
            "PUT", self._path("/tar"), params={"path": path, **_step(step_id)}, content=tar_bytes
        )
        return int(response.json()["members"])

    async def download_tar(self, path: str) -> bytes:
        response = await self._sandbox._transport.request("GET", self._path("/tar"), params={"path": path})
        return response.content


class AsyncImages:
    """``client.images``: images (``name:version`` tags over layers) and the layers themselves."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def list(self) -> list[ImageInfo]:
        response = await self._transport.request("GET", "/v1/images")
        return [ImageInfo.model_validate(item) for item in response.json()]

    async def inspect(self, ref: str) -> ImageDetail:
        response = await self._transport.request("GET", f"/v1/images/{ref}")
        return ImageDetail.model_validate(response.json())

    async def tag(self, ref: str, *, layers: builtins.list[str] | None = None, source: str | None = None) -> ImageInfo:
        """Point ``ref`` at layer digests (bottom first) or at another image's layers."""
        body = _validated(TagRequest, {"layers": layers, "source": source}).model_dump()
        response = await self._transport.request("PUT", f"/v1/images/{ref}", json=body)
        return ImageInfo.model_validate(response.json())

    async def untag(self, ref: str) -> ImageInfo:
        response = await self._transport.request("DELETE", f"/v1/images/{ref}")
        return ImageInfo.model_validate(response.json())

    async def layers(self) -> builtins.list[LayerInfo]:
        response = await self._transport.request("GET", "/v1/layers")
        return [LayerInfo.model_validate(item) for item in response.json()]

    async def remove_layer(self, digest: str) -> None:
        """Delete a layer no tag or sandbox uses (Conflict otherwise)."""
        await self._transport.request("DELETE", f"/v1/layers/{digest}")

    async def build(
        self,
        name: str,
        kind: str,
        *,
        on_progress: Callable[[str], None] | None = None,
        **options: Any,
    ) -> ImageInfo:
        """Build a layer on the server and tag it ``name``; see BuildRequest for ``kind`` and options.

        Progress lines go to ``on_progress``; a failed build raises with the builder's output.
        """
        body = _validated(BuildRequest, {"name": name, "kind": kind, **options}).model_dump(mode="json")
        timeout_s = body["timeout_s"] * max(1, len(body["commands"])) + 3600
        async for line in self._transport.stream_lines("POST", "/v1/images/build", json=body, timeout_s=timeout_s):
            event = BuildEvent.model_validate_json(line)
            if event.type == "progress" and on_progress is not None:
                on_progress(event.message or "")
            elif event.type == "error":
                raise error_from_response(0, {"error": event.error})
            elif event.type == "done" and event.image is not None:
                return event.image
        raise ServerUnavailable("the build stream ended without a result")

    async def build_dockerfile(
        self,
        name: str,
        dockerfile: str | Path,
        *,
        context: str | Path | None = None,
        build_args: dict[str, str] | None = None,
        target: str | None = None,
        no_cache: bool = False,
        network: NetworkPolicy | dict[str, Any] | None = None,
        timeout_s: float = 1800,
        on_progress: Callable[[str], None] | None = None,
    ) -> ImageInfo:
        """Build a Dockerfile on the server and tag the result ``name``.

        ``dockerfile`` and ``context`` (default: the Dockerfile's directory) are paths on the server's machine.
        ``on_progress`` gets one ``Step k/n : INSTRUCTION`` line per instruction (``(cached)`` when its layer came
        from the build cache) and the output of the RUN steps; ``timeout_s`` bounds each RUN; ``network`` is the
        RUN sandboxes' egress allowlist. A failed step raises InvalidRequest naming its line, with its output.
        """
        options = {"dockerfile": str(dockerfile), "context": str(context) if context is not None else None,
                   "build_args": build_args or {}, "target": target, "no_cache": no_cache, "network": network,
                   "timeout_s": timeout_s}  # fmt: skip
        return await self.build(name, "dockerfile", on_progress=on_progress, **options)

    async def pull(self, reference: str, *, on_progress: Callable[[PullEvent], None] | None = None) -> PullEvent:
        """Pull ``host[:port]/repo[:tag|@digest]`` from its OCI registry into the server; returns the ``done``
        event (the image, layers pulled and reused, bytes received). Layers already here are not downloaded;
        a pull of the same reference under way is joined. ``on_progress`` gets every progress event."""
        body = _validated(PullRequest, {"reference": reference}).model_dump()
        async for line in self._transport.stream_lines("POST", "/v1/images/pull", json=body, timeout_s=PULL_TIMEOUT_S):
            event = PullEvent.model_validate_json(line)
            if event.type == "progress" and on_progress is not None:
                on_progress(event)
            elif event.type == "error":
                raise error_from_response(0, {"error": event.error})
            elif event.type == "done":
                return event
        raise ServerUnavailable("the pull stream ended without a result")

    async def import_archive(
        self, ref: str, archive: str | Path | bytes, *, format: str = "tar", layer_kind: str | None = None
    ) -> ImageInfo:
        """Upload a rootfs tar or an OCI / `docker save` archive as a new layer tagged ``ref``."""
        data = archive if isinstance(archive, bytes) else Path(archive).read_bytes()
        params = {"format": format, **({"layer_kind": layer_kind} if layer_kind else {})}
        response = await self._transport.request(
            "PUT", f"/v1/images/import/{ref}", params=params, content=data, timeout_s=3600
        )
        return ImageInfo.model_validate(response.json())


class AsyncSandbox:
    """A handle on one sandbox. Plain data: pickle it, send it to another process."""

    def __init__(self, info: SandboxInfo, url: str, api_key: str, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 transport: AsyncTransport | None = None) -> None:  # fmt: skip
        self.info = info
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._own_transport: AsyncTransport | None = None
        self._shared_transport = transport
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def _transport(self) -> AsyncTransport:
        if self._shared_transport is not None:
            return self._shared_transport
        if self._own_transport is None:
            self._own_transport = AsyncTransport(self.url, self.api_key, self.timeout_s)
        return self._own_transport

    def __getstate__(self) -> dict[str, Any]:
        return {"info": self.info.model_dump(mode="json"), "url": self.url, "api_key": self.api_key,
                "timeout_s": self.timeout_s}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(SandboxInfo.model_validate(state["info"]), state["url"], state["api_key"], state["timeout_s"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state.value} image={self.info.image}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.kill()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close this handle's own connection (the sandbox keeps running)."""
        if self._own_transport is not None:
            await self._own_transport.aclose()
            self._own_transport = None

    async def refresh(self) -> SandboxInfo:
        response = await self._transport.request("GET", f"/v1/sandboxes/{self.id}")
        self.info = SandboxInfo.model_validate_json(response.content)
        return self.info

    async def kill(self, *, step_id: str | None = None) -> SandboxInfo:
        """End it now. ``step_id`` (here and on every method that changes a sandbox): the step's id in its
        trajectory log, so a resend after a trainer restart is answered from the log instead of done twice."""
        response = await self._transport.request("DELETE", f"/v1/sandboxes/{self.id}", params=_step(step_id))
        self.info = SandboxInfo.model_validate_json(response.content)
        return self.info

    async def shutdown(self, timeout_s: float = 10.0, *, step_id: str | None = None) -> SandboxInfo:
        """Stop it cleanly, then destroy it: a VM flushes its disks and powers off; a container's processes
        get SIGTERM. Whatever is still running after ``timeout_s`` is killed."""
        params = {"timeout_s": timeout_s, **_step(step_id)}
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/shutdown", params=params, timeout_s=timeout_s + 60
        )
        self.info = SandboxInfo.model_validate_json(response.content)
        return self.info

    async def set_ttl(self, ttl_s: float | None, *, step_id: str | None = None) -> SandboxInfo:
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/ttl", json={"ttl_s": ttl_s}, params=_step(step_id)
        )
        self.info = SandboxInfo.model_validate_json(response.content)
        return self.info

    async def exec(
        self,
        cmd: str | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout_s: float = DEFAULT_EXEC_TIMEOUT_S,
        stdin: str | None = None,
        output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES,
        step_id: str | None = None,
    ) -> ExecResult:
        """Run a command and wait for it. A shell string runs under /bin/sh -c.

        With ``step_id``, a step sent again (after a trainer restart) is answered from the
        trajectory log instead of running twice (``result.replayed``).
        """
        body = _exec_body(cmd, env, cwd, user, timeout_s, stdin, output_cap_bytes, step_id)
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout_s=timeout_s
        )
        return ExecResult.model_validate_json(response.content)  # the hot path: one parse

    async def exec_stream(
        self,
        cmd: str | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout_s: float = DEFAULT_EXEC_TIMEOUT_S,
        stdin: str | None = None,
        output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES,
        step_id: str | None = None,
        pty: tuple[int, int] | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command, yielding output as it comes; the last event is ``exit`` with the result.

        ``pty=(rows, cols)``: on a pseudo-terminal (all output is ``stdout``); the ``started`` event's command id
        takes keystrokes (``send_stdin``) and window sizes (``resize``) while it runs. Leaving the stream kills it."""
        body = _exec_body(cmd, env, cwd, user, timeout_s, stdin, output_cap_bytes, step_id, pty)
        async for line in self._transport.stream_lines(
            "POST", f"/v1/sandboxes/{self.id}/exec/stream", json=body, timeout_s=timeout_s
        ):
            event = ExecEvent.model_validate_json(line)
            if event.type == "error" and event.error is not None:
                raise error_from_response(0, {"error": event.error})
            yield event

    async def start(
        self,
        cmd: str | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout_s: float = DEFAULT_EXEC_TIMEOUT_S,
        output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES,
        step_id: str | None = None,
        pty: tuple[int, int] | None = None,
    ) -> CommandInfo:
        """Start a background command; its stdin stays open (see send_stdin). ``pty=(rows, cols)``: on a terminal."""
        body = _exec_body(cmd, env, cwd, user, timeout_s, None, output_cap_bytes, step_id, pty)
        response = await self._transport.request("POST", f"/v1/sandboxes/{self.id}/commands", json=body)
        return CommandInfo.model_validate(response.json())

    async def command(self, command_id: str, *, wait_s: float = 0.0) -> CommandInfo:
        """A background command's state and output so far; wait_s waits for it to finish."""
        response = await self._transport.request(
            "GET", f"/v1/sandboxes/{self.id}/commands/{command_id}", params={"wait_s": wait_s}, timeout_s=wait_s
        )
        return CommandInfo.model_validate(response.json())

    async def send_stdin(self, command_id: str, data: bytes | str, *, step_id: str | None = None) -> None:
        """Write to a background command's stdin; empty data closes it. With ``step_id``, a resend is not
        written again."""
        content = data.encode() if isinstance(data, str) else data
        await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/commands/{command_id}/stdin", content=content, params=_step(step_id)
        )

    async def resize(self, command_id: str, rows: int, cols: int, *, step_id: str | None = None) -> None:
        """Set the window size of a command started with ``pty`` (its programs get SIGWINCH)."""
        body = _validated(PtySize, {"rows": rows, "cols": cols}).model_dump(mode="json")
        await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/commands/{command_id}/resize", json=body, params=_step(step_id)
        )

    async def audit_events(self, *, after_id: int = 0) -> list[AuditEvent]:
        """What it did that a trainer should know about (quota hits, protected writes, detector findings)."""
        response = await self._transport.request("GET", f"/v1/sandboxes/{self.id}/audit", params={"after_id": after_id})
        return [AuditEvent.model_validate(item) for item in response.json()]

    async def set_network(
        self, allow: list[NetworkRule] | list[dict[str, Any]], *, step_id: str | None = None
    ) -> NetworkStatus:
        """Replace the egress allowlist while it runs, e.g. open the package mirror for setup, close it after."""
        body = _validated(NetworkPolicy, {"allow": allow}).model_dump()
        response = await self._transport.request(
            "PUT", f"/v1/sandboxes/{self.id}/network", json=body, params=_step(step_id)
        )
        return NetworkStatus.model_validate(response.json())

    async def network(self) -> NetworkStatus:
        """Its address, allowlist, and the packets its policy dropped."""
        response = await self._transport.request("GET", f"/v1/sandboxes/{self.id}/network")
        return NetworkStatus.model_validate(response.json())

    async def trajectory(self, *, after_seq: int = 0, limit: int | None = None) -> list[TrajectoryStep]:
        """The sandbox's logged commands and file writes, in order."""
        params: dict[str, Any] = {"after_seq": after_seq, **({"limit": limit} if limit else {})}
        response = await self._transport.request("GET", f"/v1/sandboxes/{self.id}/trajectory", params=params)
        return [TrajectoryStep.model_validate(item) for item in response.json()]

    async def export_trajectory(self) -> str:
        """The whole log as JSON lines."""
        response = await self._transport.request("GET", f"/v1/sandboxes/{self.id}/trajectory.jsonl", timeout_s=600)
        return response.text

    async def provenance(self, path: str) -> list[TrajectoryStep]:
        """The steps (with client step ids) that changed ``path``, oldest first."""
        response = await self._transport.request(
            "GET", f"/v1/sandboxes/{self.id}/trajectory/provenance", params={"path": path}
        )
        return [TrajectoryStep.model_validate(item) for item in response.json()]

    async def replay(
        self, *, labels: dict[str, str] | None = None, ttl_s: float | None = DEFAULT_TTL_S
    ) -> ReplayResult:
        """Re-run this sandbox's log in a fresh sandbox (returned in the result, still running)."""
        body = _validated(ReplayRequest, {"labels": labels or {}, "ttl_s": ttl_s}).model_dump()
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/trajectory/replay", json=body, timeout_s=3600
        )
        return ReplayResult.model_validate(response.json())

    async def grade(
        self,
        cmd: str | list[str],
        *,
        hidden: list[str] | None = None,
        trusted: list[str] | None = None,
        reward_path: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 600.0,
    ) -> GradeResult:
        """Grade this sandbox's final state in a separate sandbox with the ``hidden`` layers (tests, answers)
        and ``trusted`` tools on top; only what the grader writes to ``reward_path`` counts."""
        fields = {"cmd": cmd, "hidden": hidden or [], "trusted": trusted or [], "reward_path": reward_path,
                  "env": env or {}, "cwd": cwd, "timeout_s": timeout_s}  # fmt: skip
        body = _validated(GradeRequest, fields).model_dump(mode="json")
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/grade", json=body, timeout_s=timeout_s + 600
        )
        return GradeResult.model_validate(response.json())

    async def pause(self, *, wait_reclaim: bool = False, step_id: str | None = None) -> PauseResult:
        """Freeze it (processes and memory kept) and give its memory back; any request resumes it.

        Returns once frozen; ``wait_reclaim=True`` also waits until the memory is out."""
        params = {"wait_reclaim": str(wait_reclaim).lower(), **_step(step_id)}
        response = await self._transport.request("POST", f"/v1/sandboxes/{self.id}/pause", params=params, timeout_s=60)
        result = PauseResult.model_validate(response.json())
        self.info = result.sandbox
        return result

    async def resume(self, *, step_id: str | None = None) -> SandboxInfo:
        response = await self._transport.request("POST", f"/v1/sandboxes/{self.id}/resume", params=_step(step_id))
        self.info = SandboxInfo.model_validate_json(response.content)
        return self.info

    async def fork(
        self,
        count: int = 1,
        *,
        labels: dict[str, str] | None = None,
        checkpoint: str | None = None,
        step_id: str | None = None,
    ) -> list[AsyncSandbox]:
        """``count`` new sandboxes from this one as it is now (it keeps running): its filesystem, and for VMs
        its memory and processes too. ``checkpoint``: VMs only, from that checkpoint instead of from now.
        With ``step_id``, a resend answers the same children instead of making more."""
        body = _validated(ForkRequest, {"count": count, "labels": labels or {}, "checkpoint": checkpoint}).model_dump()
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/fork", json=body, params=_step(step_id), timeout_s=600
        )
        return [
            AsyncSandbox(
                SandboxInfo.model_validate(item),
                self.url,
                self.api_key,
                self.timeout_s,
                transport=self._shared_transport,
            )  # fmt: skip
            for item in response.json()
        ]

    async def checkpoint(self) -> CheckpointInfo:
        """VM sandboxes: keep its whole state now (memory, processes, disk) to restore or fork from later."""
        response = await self._transport.request("POST", f"/v1/sandboxes/{self.id}/checkpoints", timeout_s=600)
        return CheckpointInfo.model_validate(response.json())

    async def checkpoints(self) -> list[CheckpointInfo]:
        response = await self._transport.request("GET", f"/v1/sandboxes/{self.id}/checkpoints")
        return [CheckpointInfo.model_validate(item) for item in response.json()]

    async def restore(self, checkpoint: str) -> SandboxInfo:
        """VM sandboxes: rewind this sandbox to a checkpoint of its own; what happened since is gone."""
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/checkpoints/{checkpoint}/restore", timeout_s=600
        )
        self.info = SandboxInfo.model_validate_json(response.content)
        return self.info

    async def snapshot(self, name: str | None = None, *, step_id: str | None = None) -> SnapshotInfo:
        """Its filesystem changes so far as a diff layer; ``client.create(layers=info.layers)`` continues from here."""
        response = await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/snapshot", json={"name": name}, params=_step(step_id), timeout_s=600
        )
        return SnapshotInfo.model_validate(response.json())

    async def signal(self, command_id: str, signo: int = 9, *, step_id: str | None = None) -> None:
        await self._transport.request(
            "POST", f"/v1/sandboxes/{self.id}/commands/{command_id}/signal", json={"signal": signo},
            params=_step(step_id),
        )  # fmt: skip


class AsyncClient:
    """Entry point of the SDK. Settings: argument > CORRAL_URL/CORRAL_API_KEY > config file."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.url, self.api_key = resolve_connection(url, api_key)
        self.timeout_s = timeout_s
        self._transport = AsyncTransport(self.url, self.api_key, timeout_s)
        self.images = AsyncImages(self._transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _handle(self, info: SandboxInfo) -> AsyncSandbox:
        return AsyncSandbox(info, self.url, self.api_key, self.timeout_s, transport=self._transport)

    async def create(
        self,
        image: str = "busybox",
        *,
        cpu: float = DEFAULT_CPU,
        qos: str = DEFAULT_QOS,
        memory_mb: int = DEFAULT_MEMORY_MB,
        pids_max: int = DEFAULT_PIDS_MAX,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        labels: dict[str, str] | None = None,
        ttl_s: float | None = DEFAULT_TTL_S,
        runtime: str | None = None,
        backend: str = "container",
        environment: Environment | dict[str, Any] | None = None,
        layers: list[str] | None = None,
        idle_pause_s: float | None = None,
        ttl_counts_paused: bool = False,
        network: NetworkPolicy | dict[str, Any] | None = None,
        protected_paths: list[str] | None = None,
        disk_mb: int | None = None,
        sensitive_paths: list[str] | None = None,
        node_selector: dict[str, str] | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox from ``image``, an ``environment`` ({base, workspace, tools}), or ``layers``;
        ``node_selector``: only on a node whose labels include each of its key=value pairs.

        ``image`` (or an environment part) may be a registry reference (``127.0.0.1:5000/ns/img:tag``): the
        server pulls it on first use, once however many creates wait for it. ``env`` goes over the image's
        own; ``cwd`` and ``user`` default to the image's (a pulled image's WorkingDir and User), else / and root."""
        fields = {
            "image": image, "environment": environment, "layers": layers, "backend": backend, "runtime": runtime,
            "cpu": cpu, "qos": qos, "memory_mb": memory_mb, "pids_max": pids_max, "env": env or {}, "cwd": cwd,
            "user": user,
            "labels": labels or {}, "ttl_s": ttl_s, "idle_pause_s": idle_pause_s,
            "ttl_counts_paused": ttl_counts_paused, "network": network, "protected_paths": protected_paths or [],
            "disk_mb": disk_mb, "sensitive_paths": sensitive_paths or [], "node_selector": node_selector or {},
        }  # fmt: skip
        body = _validated(CreateSandboxRequest, fields)
        # A VM boots (and its first create on a node may build its disk): give it the server's own bound.
        wait_s = None if body.backend == "container" else VM_CREATE_TIMEOUT_S
        parts = body.environment
        refs = [body.image] if parts is None else [parts.base, parts.workspace or "", parts.tools or "", *parts.extra]
        if not body.layers and any(is_registry_reference(ref) for ref in refs):
            wait_s = max(wait_s or 0.0, PULL_TIMEOUT_S)  # it may wait for a pull
        response = await self._transport.request(
            "POST", "/v1/sandboxes", json=body.model_dump(mode="json"), timeout_s=wait_s
        )
        return self._handle(SandboxInfo.model_validate_json(response.content))

    async def create_many(
        self,
        count: int,
        image: str = "busybox",
        *,
        concurrency: int = 512,
        per_node: int = 32,
        on_progress: Callable[[BatchEvent], None] | None = None,
        node_selector: dict[str, str] | None = None,
        **create_args: Any,
    ) -> AsyncIterator[AsyncSandbox]:
        """``count`` sandboxes in one request, each handed over as soon as it is ready (in that order).

        ``create_args`` and ``node_selector`` are ``create``'s. The server runs at most ``concurrency`` creates
        at once and at most ``per_node`` on one node. ``on_progress`` gets every progress, failure ("error") and
        final "done" event; without it, failures raise once the stream ends (after every ready sandbox was handed
        over).
        """
        fields = {"image": image, "count": count, "concurrency": concurrency, "per_node": per_node,
                  "node_selector": node_selector or {}, **create_args}  # fmt: skip
        body = _validated(BatchCreateRequest, fields).model_dump(mode="json", exclude_unset=True)
        failures: list[BatchEvent] = []
        lines = self._transport.stream_lines("POST", "/v1/sandboxes/batch", json=body, timeout_s=BATCH_TIMEOUT_S)
        async for line in lines:
            event = BatchEvent.model_validate_json(line)
            if event.type == "sandbox" and event.sandbox is not None:
                yield self._handle(event.sandbox)
                continue
            if event.type == "error":
                failures.append(event)
            if on_progress is not None:
                on_progress(event)
        if failures and on_progress is None:
            first = failures[0].error or {}
            raise error_from_response(
                0, {"error": {**first, "message": f"{len(failures)} of {count} creates failed; the first: "
                              f"{first.get('message', '')}"}}
            )  # fmt: skip

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        response = await self._transport.request("GET", f"/v1/sandboxes/{sandbox_id}")
        return self._handle(SandboxInfo.model_validate_json(response.content))

    def connect(self, sandbox: AsyncSandbox) -> AsyncSandbox:
        """Share this client's connection pool with an unpickled handle."""
        return AsyncSandbox(sandbox.info, self.url, self.api_key, self.timeout_s, transport=self._transport)

    async def list(self, *, state: list[str] | None = None, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = {"state": state or [], "label": [f"{k}={v}" for k, v in (labels or {}).items()]}
        response = await self._transport.request("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.model_validate(item) for item in response.json()]

    async def kill(self, sandbox_id: str) -> SandboxInfo:
        response = await self._transport.request("DELETE", f"/v1/sandboxes/{sandbox_id}")
        return SandboxInfo.model_validate_json(response.content)

    async def cluster_nodes(self) -> builtins.list[ClusterNode]:
        """Every node in the shared state (several servers on one PostgreSQL): up or lost, last heartbeat, load."""
        response = await self._transport.request("GET", "/v1/cluster/nodes")
        return [ClusterNode.model_validate(item) for item in response.json()]

    async def nodes(self) -> builtins.list[NodeStats]:
        """Each node's sandboxes per backend and state, CPU and memory committed vs used vs reclaimed, pressure."""
        response = await self._transport.request("GET", "/v1/nodes")
        return [NodeStats.model_validate(item) for item in response.json()]

    async def fncall(
        self,
        cmd: str | builtins.list[str] | None = None,
        *,
        code: str | None = None,
        args: builtins.list[Any] | None = None,
        image: str | None = None,
        files: dict[str, str] | None = None,
        stdin: str | None = None,
        timeout_s: float = 30.0,
        memory_mb: int = 256,
        cpu: float = 1.0,
        network: NetworkPolicy | dict[str, Any] | None = None,
    ) -> FnCallResult:
        """One short isolated call from a pool of pre-warmed sandboxes (the ``fncall`` backend).

        Give ``cmd`` (a shell command) or ``code`` (Python defining ``main(*args)``, whose return
        value comes back as ``result``). Nothing a call writes or starts is seen by the next one.
        """
        fields = {"cmd": cmd, "code": code, "args": args or [], "image": image, "files": files or {}, "stdin": stdin,
                  "timeout_s": timeout_s, "memory_mb": memory_mb, "cpu": cpu, "network": network}  # fmt: skip
        body = _validated(FnCallRequest, fields).model_dump(mode="json")
        response = await self._transport.request("POST", "/v1/fncall", json=body, timeout_s=timeout_s)
        return FnCallResult.model_validate_json(response.content)

    async def fncall_batch(
        self, calls: builtins.list[FnCallRequest | dict[str, Any]]
    ) -> builtins.list[FnCallResult | CorralError]:
        """Many calls in one request, run concurrently; a failed call comes back as its error, in place."""
        body = _validated(FnCallBatch, {"calls": calls}).model_dump(mode="json")
        timeout_s = sum(call["timeout_s"] for call in body["calls"])
        response = await self._transport.request("POST", "/v1/fncall/batch", json=body, timeout_s=timeout_s)
        return [
            error_from_response(0, item)
            if "error" in item and "exit_code" not in item
            else FnCallResult.model_validate(item)
            for item in response.json()
        ]

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        tests: builtins.list[dict[str, Any]] | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 256,
        image: str | None = None,
    ) -> RunCodeResult:
        """Run a program against tests ({"stdin", "expected_stdout"}), each in its own isolated call."""
        fields: dict[str, Any] = {"language": language, "code": code, "timeout_s": timeout_s, "memory_mb": memory_mb,
                                  "image": image, **({"tests": tests} if tests is not None else {})}  # fmt: skip
        body = _validated(RunCodeRequest, fields).model_dump(mode="json")
        response = await self._transport.request("POST", "/v1/run_code", json=body, timeout_s=timeout_s * 100)
        return RunCodeResult.model_validate(response.json())

    async def fncall_pools(self) -> builtins.list[PoolStats]:
        response = await self._transport.request("GET", "/v1/fncall/pools")
        return [PoolStats.model_validate(item) for item in response.json()]

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        """Plug a namespace of the server's machine (a package mirror, an uplink) into the sandbox network."""
        body = {"name": name, "netns_path": netns_path, "address": address}
        await self._transport.request("POST", "/v1/network/peers", json=body)

    async def events(
        self,
        *,
        after_id: int = 0,
        follow: bool = False,
        sandbox_id: str | None = None,
        kinds: builtins.list[str] | None = None,
        labels: dict[str, str] | None = None,
    ) -> AsyncIterator[Event]:
        """What happened to sandboxes and nodes, and audit findings, oldest first, from ``after_id`` on.
        ``follow``: keep going as new events happen (until the caller stops iterating); resume a lost stream
        with the last id seen. Node events need the server's key."""
        params: dict[str, Any] = {
            "after_id": after_id,
            "follow": follow,
            **({"sandbox_id": sandbox_id} if sandbox_id else {}),
            **({"kind": kinds} if kinds else {}),
            **({"label": [f"{key}={value}" for key, value in labels.items()]} if labels else {}),
        }
        lines = self._transport.stream_lines("GET", "/v1/events", params=params, timeout_s=EVENTS_QUIET_S)
        async for line in lines:
            yield Event.model_validate_json(line)

    async def audit_events(
        self, *, after_id: int = 0, severity: str | None = None, wait_s: float = 0.0
    ) -> builtins.list[AuditEvent]:
        """Audit events of every sandbox after ``after_id``; ``wait_s`` waits for new ones (a stream, by polling)."""
        params: dict[str, Any] = {
            "after_id": after_id,
            "wait_s": wait_s,
            **({"severity": severity} if severity else {}),
        }
        response = await self._transport.request("GET", "/v1/audit", params=params, timeout_s=wait_s)
        return [AuditEvent.model_validate(item) for item in response.json()]

    async def issue_job_token(self, job: str) -> str:
        """A bearer token that reaches only sandboxes labelled job=<job>: hand it to a trainer so that,
        restarted after preemption, it reconnects to its own sandboxes (``Client(url, token)``) and no others."""
        response = await self._transport.request("POST", f"/v1/jobs/{job}/token")
        return str(response.json()["token"])

    async def revoke_job_tokens(self, job: str) -> int:
        response = await self._transport.request("DELETE", f"/v1/jobs/{job}/token")
        return int(response.json()["revoked"])

    async def bulk(
        self, labels: dict[str, str], action: str, *, ttl_s: float | None = None, clear_ttl: bool = False
    ) -> BulkResult:
        """``action`` ("pause", "resume", "kill", "set_ttl") on every live sandbox whose labels match; the answer
        comes when every one is done (a kill of 10,000 on one 2-core node took ten minutes), so it waits up to an
        hour."""
        body = _validated(BulkRequest, {"labels": labels, "action": action, "ttl_s": ttl_s, "clear_ttl": clear_ttl})
        response = await self._transport.request("POST", "/v1/sandboxes/bulk", json=body.model_dump(), timeout_s=3600)
        return BulkResult.model_validate(response.json())
