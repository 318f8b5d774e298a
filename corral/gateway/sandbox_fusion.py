"""A SandboxFusion-compatible API: ``POST /run_code`` and ``POST /run_jupyter``, served by the fncall pools.

SandboxFusion (bytedance/SandboxFusion) is what verl's ``SandboxFusionTool``,
its reward scoring (``reward_model.sandbox_fusion.url``) and many code-RL
recipes call. The request and response bodies here are SandboxFusion's, field
for field (its server's ``sandbox_api.py`` and the ``sandbox-fusion`` client
package's models), so pointing such a client at Corral is a URL change.

Each call takes a pre-warmed sandbox of a fncall pool (per image and memory
limit), writes the request's files under /tmp (relative paths; absolute ones
as given), compiles with ``compile_timeout`` if the language is compiled, runs
with ``run_timeout`` and the stdin, reads ``fetch_files`` back, and gives the
sandbox back: as for every fncall, it serves the next call only if nothing of
this one is left, else it is replaced. Python, bash and Node.js code without
files runs from the command line (``python3 -c``), so it writes nothing and
its sandbox is reused; compiled code and files make a replacement. Python and
bash run on ``debian-12``; C, C++, Java, Go and Node.js on the toolchain image
(``debian-12-toolchains``, corral/images/bases.py), which is built on this
node's first call that needs it (the call answers ``SandboxError`` saying so;
``corral sandbox-fusion --build`` or setup.sh's ``CORRAL_SETUP_TOOLCHAINS=1``
build it ahead).

Authentication: SandboxFusion has none, and its clients send no header, so
the key can ride in the URL: ``/sandbox-fusion/<key>/run_code``, where the key
is derived from the server's API key (``sandbox_fusion_key``; ``corral
sandbox-fusion`` prints the URL) and grants only these two routes. The
root-level ``/run_code`` and ``/run_jupyter`` take the API key or a job token as
a bearer header, or nothing when ``CORRAL_SANDBOX_FUSION_OPEN`` is set (for a
server only the trainer can reach). docs/integrations.md has the verl config.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import posixpath
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi import Path as FastApiPath
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from corral.api.errors import AuthenticationError, CorralError, InvalidRequest, NotFound
from corral.api.models import ExecRequest, ExecResult, FnCallRequest
from corral.gateway.e2b.common import signed_token
from corral.gateway.fncall import FnCallService
from corral.gateway.images import ImageService
from corral.gateway.sandbox_fusion_jupyter import MARKER as _JUPYTER_MARKER
from corral.images.bases import GO_CACHE_DIR, KNOWN_IMAGE_NAMES, TOOLCHAIN_IMAGE

__all__ = [
    "BUILDING",
    "LANGUAGES",
    "SandboxFusion",
    "SandboxFusionRunCodeRequest",
    "SandboxFusionRunCodeResponse",
    "SandboxFusionRunJupyterRequest",
    "SandboxFusionRunJupyterResponse",
    "include_sandbox_fusion",
    "sandbox_fusion_key",
]

log = logging.getLogger(__name__)

WORK_DIR = "/tmp"
BUILDING = "building the image"  # how the answer to a call starts while the image it needs is built
BASE_IMAGE = "debian-12"
DEFAULT_MEMORY_MB = 1024  # memory_limit_MB -1 (SandboxFusion's "no limit"): the sandbox still needs one
OUTPUT_CAP_BYTES = 1 << 20  # per stream, as SandboxFusion keeps
_INLINE_MAX_BYTES = 64 << 10  # code up to this size runs from argv (one argument may be at most 128 KiB)
_JUPYTER_DRIVER = (Path(__file__).with_name("sandbox_fusion_jupyter.py")).read_text()
_KERNEL = (Path(__file__).parent / "e2b" / "kernel_main.py").read_text()
_JUPYTER_GRACE_S = 1.0  # the driver's own start and the kernel's, on top of the cells' total_timeout
_GO_ENV = {"GOCACHE": GO_CACHE_DIR, "CGO_ENABLED": "0", "HOME": WORK_DIR, "GOPATH": f"{WORK_DIR}/go"}


@dataclass(frozen=True)
class Language:
    """How one of SandboxFusion's languages runs: its source file, the compile step, the run step."""

    source: str  # the file the code goes to, under WORK_DIR
    run: tuple[str, ...]  # argv; the request's args follow
    compile: tuple[str, ...] | None = None
    inline: tuple[str, ...] | None = None  # argv that takes the code itself next (no file written)
    image: Literal["base", "toolchains"] = "toolchains"
    env: dict[str, str] = field(default_factory=dict)


LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", ("python3", "main.py"), inline=("python3", "-B", "-c"), image="base"),
    "bash": Language("main.sh", ("bash", "main.sh"), inline=("bash", "-c"), image="base"),
    "nodejs": Language("main.js", ("node", "main.js"), inline=("node", "-e")),
    "cpp": Language("main.cpp", ("./main",), compile=("g++", "-std=c++17", "main.cpp", "-o", "main", "-lpthread")),
    "c": Language("main.c", ("./main",), compile=("gcc", "main.c", "-o", "main", "-lm")),
    "java": Language("Main.java", ("java", "-ea", "Main"), compile=("javac", "Main.java")),
    "go": Language("main.go", ("./main",), compile=("go", "build", "-o", "main", "main.go"), env=_GO_ENV),
}
LANGUAGES["js"] = LANGUAGES["nodejs"]
SandboxFusionLanguage = Literal["python", "bash", "nodejs", "js", "cpp", "c", "java", "go"]


# -- the wire format (SandboxFusion's models) ----------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as SandboxFusion's server: unknown fields are ignored


class SandboxFusionRunCodeRequest(_Wire):
    compile_timeout: float = Field(10, gt=0, le=3600, description="compile timeout for compiled languages")
    run_timeout: float = Field(10, gt=0, le=3600, description="code run timeout")
    memory_limit_MB: int = Field(-1, description=f"maximum memory allowed in megabytes; -1: {DEFAULT_MEMORY_MB}")
    code: str = Field(description="the code to run")
    stdin: str | None = Field(None, description="optional string to pass into stdin")
    language: SandboxFusionLanguage = Field(description="the language to run the code in")
    files: dict[str, str | None] = Field(default_factory=dict, description="file path to base64 content")
    fetch_files: list[str] = Field(default_factory=list, description="file paths to fetch after the run")
    args: list[str] = Field(default_factory=list, description="command-line arguments of the program")


class SandboxFusionCommandResult(_Wire):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class SandboxFusionRunCodeResponse(_Wire):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: SandboxFusionCommandResult | None = None
    run_result: SandboxFusionCommandResult | None = None
    executor_pod_name: str | None = Field(None, description="Corral: the sandbox that ran it")
    files: dict[str, str] = Field(default_factory=dict)


class SandboxFusionRunJupyterRequest(_Wire):
    cells: list[str] = Field(description="code blocks run in order in one Python kernel")
    cell_timeout: float = Field(0, ge=0, description="max run time of each cell; 0: none")
    total_timeout: float = Field(45, gt=0, le=3600, description="max run time of all the cells")
    memory_limit_MB: int = Field(-1, description=f"maximum memory allowed in megabytes; -1: {DEFAULT_MEMORY_MB}")
    kernel: Literal["python3"] = "python3"
    files: dict[str, str | None] = Field(default_factory=dict, description="file path to base64 content")
    fetch_files: list[str] = Field(default_factory=list)


class SandboxFusionCellResult(_Wire):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class SandboxFusionRunJupyterResponse(_Wire):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    driver: SandboxFusionCommandResult | None = None
    cells: list[SandboxFusionCellResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


# -- running -------------------------------------------------------------------


def _command_result(result: ExecResult) -> SandboxFusionCommandResult:
    return SandboxFusionCommandResult(
        status="TimeLimitExceeded" if result.timed_out else "Finished",
        execution_time=result.duration_ms / 1000,
        return_code=None if result.timed_out else result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
    )


def _succeeded(result: SandboxFusionCommandResult | None) -> bool:
    return result is None or (result.status == "Finished" and result.return_code == 0)


def _path(name: str) -> str:
    return posixpath.normpath(posixpath.join(WORK_DIR, name))


class _Unavailable(CorralError):
    """The call cannot run yet (its image is being built): answered as SandboxFusion's SandboxError."""


class SandboxFusion:
    """What the routes run calls with; owned by the app's lifespan."""

    def __init__(self, fncalls: FnCallService, images: ImageService, toolchain_image: str) -> None:
        self._fncalls = fncalls
        self._images = images
        self.toolchain_image = toolchain_image
        self._present: set[str] = set()
        self._builds: dict[str, asyncio.Task[str | None]] = {}

    # -- images ----------------------------------------------------------------

    def _image(self, language: Language) -> str:
        """The image a language runs on; a missing one of corral/images/bases.py's starts its build here."""
        name = BASE_IMAGE if language.image == "base" else self.toolchain_image
        if name in self._present:
            return name
        try:
            self._images.inspect(name)
        except NotFound:
            if name not in KNOWN_IMAGE_NAMES:
                raise
            build = self._start_build(name)
            if not build.done():
                raise _Unavailable(
                    f"{BUILDING} {name} for its first use on this node (debian-12-toolchains: gcc, g++, JDK, Go and "
                    "Node.js from Debian, minutes); try again then (`corral sandbox-fusion --build` waits for it)"
                ) from None
            raise _Unavailable(f"the build of {name} failed (the next call tries again): {build.result()}") from None
        self._present.add(name)
        return name

    def _start_build(self, name: str) -> asyncio.Task[str | None]:
        """The image's build, started unless one is running or done (a failed one starts again); its result is
        its error, None once built."""
        build = self._builds.get(name)
        if build is None or (build.done() and build.result() is not None):
            build = self._builds[name] = asyncio.get_running_loop().create_task(self._build(name))
        return build

    async def _build(self, name: str) -> str | None:
        try:
            await self._images.ensure_base_image(name)
        except (CorralError, RuntimeError, OSError) as exc:
            log.warning("building %s failed: %s", name, exc)
            return str(exc)[-2000:]
        log.info("built %s", name)
        return None

    async def close(self) -> None:
        for build in self._builds.values():
            build.cancel()  # a build's thread finishes on its own, under the store's lock
        await asyncio.gather(*self._builds.values(), return_exceptions=True)

    # -- calls -----------------------------------------------------------------

    def _pool(self, image: str, memory_limit_mb: int) -> FnCallRequest:
        return FnCallRequest(image=image, memory_mb=memory_limit_mb if memory_limit_mb > 0 else DEFAULT_MEMORY_MB)

    async def _write_files(self, sandbox_id: str, files: dict[str, str | None]) -> None:
        for name, content in files.items():
            if content is None:  # SandboxFusion skips these too
                continue
            try:
                data = base64.b64decode(content, validate=True)
            except binascii.Error:
                raise InvalidRequest(f"files[{name!r}] is not base64") from None
            await self._fncalls.write_file(sandbox_id, _path(name), data)

    async def _fetch_files(self, sandbox_id: str, names: list[str]) -> dict[str, str]:
        """The files that exist and are regular files, base64, by the name asked for (a missing one is left out)."""
        fetched = {}
        for name in names:
            try:
                data = await self._fncalls.read_file(sandbox_id, _path(name))
            except (NotFound, InvalidRequest):
                continue
            fetched[name] = base64.b64encode(data).decode()
        return fetched

    async def run_code(self, request: SandboxFusionRunCodeRequest) -> SandboxFusionRunCodeResponse:
        language = LANGUAGES[request.language]
        try:
            pool = self._pool(self._image(language), request.memory_limit_MB)
            return (
                await self._fncalls.in_pool(pool, lambda sandbox_id: self._run_code(sandbox_id, language, request))
            )[0]
        except CorralError as exc:  # SandboxFusion answers its own failures as a SandboxError, with status 200
            return SandboxFusionRunCodeResponse(status="SandboxError", message=exc.message)

    async def _run_code(
        self, sandbox_id: str, language: Language, request: SandboxFusionRunCodeRequest
    ) -> SandboxFusionRunCodeResponse:
        await self._write_files(sandbox_id, request.files)
        if language.inline is not None and not request.files and len(request.code.encode()) <= _INLINE_MAX_BYTES:
            run_argv = [*language.inline, request.code, *request.args]
        else:
            await self._fncalls.write_file(sandbox_id, _path(language.source), request.code.encode())
            run_argv = [*language.run, *request.args]
        compiled = None
        if language.compile is not None:
            compiled = _command_result(
                await self._fncalls.exec(
                    sandbox_id, self._exec(list(language.compile), language, request.compile_timeout)
                )
            )
        ran = None
        if _succeeded(compiled):
            ran = _command_result(
                await self._fncalls.exec(sandbox_id, self._exec(run_argv, language, request.run_timeout, request.stdin))
            )
        return SandboxFusionRunCodeResponse(
            status="Success" if _succeeded(compiled) and ran is not None and _succeeded(ran) else "Failed",
            message="",
            compile_result=compiled,
            run_result=ran,
            executor_pod_name=sandbox_id,
            files=await self._fetch_files(sandbox_id, request.fetch_files),
        )

    @staticmethod
    def _exec(argv: list[str], language: Language, timeout_s: float, stdin: str | None = None) -> ExecRequest:
        return ExecRequest(
            cmd=argv,
            cwd=WORK_DIR,
            env=language.env,
            timeout_s=timeout_s,
            stdin=stdin,
            output_cap_bytes=OUTPUT_CAP_BYTES,
        )

    async def run_jupyter(self, request: SandboxFusionRunJupyterRequest) -> SandboxFusionRunJupyterResponse:
        try:
            pool = self._pool(BASE_IMAGE, request.memory_limit_MB)
            return (await self._fncalls.in_pool(pool, lambda sandbox_id: self._run_jupyter(sandbox_id, request)))[0]
        except CorralError as exc:
            return SandboxFusionRunJupyterResponse(status="SandboxError", message=exc.message)

    async def _run_jupyter(
        self, sandbox_id: str, request: SandboxFusionRunJupyterRequest
    ) -> SandboxFusionRunJupyterResponse:
        await self._write_files(sandbox_id, request.files)
        stdin = json.dumps({"kernel": _KERNEL, "cells": request.cells, "cell_timeout": request.cell_timeout})
        result = await self._fncalls.exec(
            sandbox_id,
            ExecRequest(
                cmd=["python3", "-u", "-c", _JUPYTER_DRIVER], cwd=WORK_DIR, stdin=stdin,
                timeout_s=request.total_timeout + _JUPYTER_GRACE_S, output_cap_bytes=OUTPUT_CAP_BYTES,
            ),
        )  # fmt: skip
        head, _, outcome = result.stdout.rpartition(_JUPYTER_MARKER)
        driver = _command_result(result.model_copy(update={"stdout": head if outcome else result.stdout}))
        files = await self._fetch_files(sandbox_id, request.fetch_files)
        if result.timed_out or not outcome:  # as SandboxFusion: a driver that did not finish reports no cells
            return SandboxFusionRunJupyterResponse(
                status="Failed", message="", driver=driver, executor_pod_name=sandbox_id, files=files
            )
        cells = [SandboxFusionCellResult(**cell) for cell in json.loads(outcome)["cells"]]
        return SandboxFusionRunJupyterResponse(
            status="Success", message="", driver=driver, cells=cells, executor_pod_name=sandbox_id, files=files
        )


# -- routes --------------------------------------------------------------------


def sandbox_fusion_key(server_key: str) -> str:
    """The key in ``/sandbox-fusion/<key>/run_code`` that goes with a Corral server key: it opens these routes only."""
    return "sf_" + signed_token(server_key, "sandbox-fusion-key")


_bearer = HTTPBearer(auto_error=False)
UrlKey = Annotated[str, FastApiPath(description="The server's SandboxFusion key (`corral sandbox-fusion` prints it).")]


async def _by_url_key(request: Request, key: UrlKey) -> None:
    expected = sandbox_fusion_key(request.app.state.service.tokens.server_key)
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise AuthenticationError("wrong key in the URL: `corral sandbox-fusion` prints this server's URL")


async def _by_bearer(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The API key or a job token, unless CORRAL_SANDBOX_FUSION_OPEN."""
    if not request.app.state.sandbox_fusion_open:
        request.app.state.service.tokens.caller(credentials.credentials if credentials else None)


router = APIRouter(tags=["sandbox-fusion"])


def _serve(prefix: str, authorize: Callable[..., Awaitable[None]]) -> None:
    @router.post(f"{prefix}/run_code", dependencies=[Depends(authorize)])
    async def run_code(body: SandboxFusionRunCodeRequest, request: Request) -> SandboxFusionRunCodeResponse:
        """SandboxFusion's run_code: compile (C, C++, Java, Go), then run, in a pooled sandbox."""
        facade: SandboxFusion = request.app.state.sandbox_fusion
        return await facade.run_code(body)

    @router.post(f"{prefix}/run_jupyter", dependencies=[Depends(authorize)])
    async def run_jupyter(body: SandboxFusionRunJupyterRequest, request: Request) -> SandboxFusionRunJupyterResponse:
        """SandboxFusion's run_jupyter: the cells in order in one Python kernel, in a pooled sandbox."""
        facade: SandboxFusion = request.app.state.sandbox_fusion
        return await facade.run_jupyter(body)


_serve("", _by_bearer)  # SandboxFusion's own paths
_serve("/sandbox-fusion/{key}", _by_url_key)  # for clients that cannot send a header (verl, sandbox-fusion)


def include_sandbox_fusion(app: FastAPI, *, open_access: bool, toolchain_image: str = TOOLCHAIN_IMAGE) -> None:
    """Serve the SandboxFusion API on ``app`` (``open_access``: the root routes need no key)."""
    inner = app.router.lifespan_context
    app.state.sandbox_fusion_open = open_access
    if open_access:
        log.warning("CORRAL_SANDBOX_FUSION_OPEN: /run_code and /run_jupyter run code for anyone who reaches this port")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with inner(app) as state:
            services = app.state.service
            app.state.sandbox_fusion = SandboxFusion(services.fncall, services.images, toolchain_image)
            try:
                yield state
            finally:
                await app.state.sandbox_fusion.close()

    app.router.lifespan_context = lifespan
    app.include_router(router)
