"""Dockerfile builds: each stage's instructions run in order, on the layers built so far.

RUN runs in a builder sandbox on the stack so far (ImageService.builder_sandbox, the same one
`images build --on IMAGE --run CMD` uses) and keeps only what it changed, as a diff layer. COPY and
ADD upload an archive into such a sandbox, so a destination resolves through the image's own
symlinks as it would in Docker (/bin -> usr/bin on Debian); on `scratch` there is nothing to
resolve, and the first layer is packed straight from a tree on the server. The archive carries
the owners Docker gives (root for the context, the source's for COPY --from and a local tar,
--chown's numbers from the image's /etc/passwd) and every mode bit, setuid included, and the
upload keeps both (``keep_owners``), so nothing runs chown in the image. ENV, ARG, WORKDIR, USER,
ENTRYPOINT, CMD, LABEL, EXPOSE and SHELL make no layer: they change the image config (kept with the
image's tag and applied to sandboxes created from it) or the state of later steps.

Every layer step is cached in the catalogue's build cache by its inputs: the stack it runs on, the
instruction after substitution, the environment, user and directory it runs with, and for COPY/ADD a
digest of the files it reads. Editing line k reruns k and what follows; the steps before are hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import posixpath
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.api.errors import CorralError, InvalidRequest, NotFound
from corral.api.models import BuildEvent, BuildRequest, ExecRequest, NetworkPolicy, is_registry_reference
from corral.images.builders import Progress
from corral.images.catalogue import Catalogue, input_key
from corral.images.dockerfile import (
    IGNORED_INSTRUCTIONS,
    BuildContext,
    CopyArchive,
    CopyArgs,
    Dockerfile,
    Instruction,
    Stage,
    argv,
    is_local_archive,
    json_array,
    key_values,
    numeric_owner,
    parse_copy,
    parse_dockerfile,
    sources_digest,
    substitute,
    substitutes,
    walk_all,
)
from corral.images.image_config import ImageConfig
from corral.images.store import ImageRecord, parse_ref
from corral.images.unpack import extract_tar

if TYPE_CHECKING:
    from corral.gateway.images import ImageService
    from corral.gateway.service import SandboxService

__all__ = ["DockerfileBuild", "PullImage"]

PullImage = Callable[[str, Progress], Awaitable[ImageRecord]]
"""Fetches a registry reference (``host:port/ns/img:tag``) into the catalogue and returns the image, layers and
config: the hook a registry client plugs into for ``FROM`` of a registry image."""

_DEFAULT_SHELL = ["/bin/sh", "-c"]
_ARCHIVE_MAX_BYTES = 4 << 30
_STEP_TTL_S = 600.0


@dataclass
class _StageState:
    stack: list[str]
    config: ImageConfig
    args: dict[str, str] = field(default_factory=dict)  # the ARGs declared in this stage, with their values
    shell: list[str] = field(default_factory=lambda: list(_DEFAULT_SHELL))
    workdir_made: bool = True  # the working directory exists in ``stack`` (WORKDIR alone does not make it)

    def variables(self) -> dict[str, str]:
        """What ``$NAME`` means here: ENV wins over ARG, as in Docker."""
        return {**self.args, **self.config.env}


class DockerfileBuild:
    """One ``kind="dockerfile"`` build; ``run()`` tags the result and says whether every step was cached."""

    def __init__(
        self,
        images: ImageService,
        catalogue: Catalogue,
        sandboxes: SandboxService,
        request: BuildRequest,
        *,
        emit: Callable[[BuildEvent], None],
        puller: PullImage | None,
    ) -> None:
        self._images = images
        self._catalogue = catalogue
        self._sandboxes = sandboxes
        self._request = request
        self._emit = emit
        self._puller = puller
        self._stages: dict[int, _StageState] = {}  # built so far, by stage index
        self._dockerfile: Dockerfile | None = None
        self._current = 0  # the index of the stage being built
        self._step = 0
        self._steps = 0
        self._all_cached = True

    def _progress(self, message: str) -> None:
        self._emit(BuildEvent(type="progress", message=message))

    async def run(self) -> tuple[ImageRecord, bool]:
        request = self._request
        name, version = parse_ref(request.name)
        if not request.dockerfile:
            raise InvalidRequest("a dockerfile build needs `dockerfile`: the Dockerfile's path on the server's machine")
        path = Path(request.dockerfile).resolve()
        if not path.is_file():
            raise NotFound(f"no Dockerfile {path} on the server's machine")
        dockerfile = self._dockerfile = parse_dockerfile(path.read_text(errors="replace"))
        context = BuildContext(Path(request.context) if request.context else path.parent)
        global_args: dict[str, str] = {}
        for instruction in dockerfile.global_args:
            declared = substitute(instruction.value, global_args, instruction.escape)
            for key, default in key_values(instruction, declared).items():
                global_args[key] = request.build_args.get(key, default)
        stages = dockerfile.needed(request.target)
        self._steps = sum(1 + len(stage.body) for stage in stages)
        for stage in stages:
            self._current = stage.index
            state = await self._from(stage, global_args)
            for instruction in stage.body:
                await self._instruction(instruction, state, context, global_args)
            await self._make_workdir(state, stage)
            self._stages[stage.index] = state
        final = self._stages[stages[-1].index]
        if not final.stack:
            raise InvalidRequest("the image has no layers: a stage FROM scratch needs a COPY or ADD")
        image = self._catalogue.tag(name, final.stack, version=version, config=final.config)
        return image, self._all_cached

    # -- FROM -----------------------------------------------------------

    def _earlier_stage(self, ref: str) -> _StageState | None:
        """The built stage ``ref`` (a name or an index) names, among those before the current one."""
        assert self._dockerfile is not None
        stage = self._dockerfile.stage(ref, self._current)
        return self._stages.get(stage.index) if stage is not None else None

    async def _from(self, stage: Stage, global_args: dict[str, str]) -> _StageState:
        self._announce(stage.from_instruction, cached=None)
        base = substitute(stage.base, global_args, stage.from_instruction.escape)
        if base == "scratch":  # no /etc/passwd to find "root" in: uid 0, as Docker's default user is
            return _StageState(stack=[], config=ImageConfig(user="0"))
        built = self._earlier_stage(base)
        if built is not None:
            return _StageState(stack=list(built.stack), config=built.config.model_copy(deep=True))
        image = await self._image(base, stage.from_instruction)
        return _StageState(stack=list(image.layers), config=image.config.model_copy(deep=True))

    async def _image(self, ref: str, instruction: Instruction) -> ImageRecord:
        """A Corral image ``name[:version]``, or a registry reference (``host[:port]/repo...``) through the puller."""
        if not is_registry_reference(ref):
            try:
                return self._catalogue.resolve(ref)
            except (NotFound, InvalidRequest) as exc:
                raise type(exc)(f"{instruction.where()}: {exc.message}") from None
        if self._puller is None:
            raise InvalidRequest(
                f"{instruction.where()}: {ref!r} is a registry reference, and this server does not pull from "
                "registries: import the image (`corral images import --oci`) and use its Corral name"
            )
        try:
            return await self._puller(ref, self._progress)
        except CorralError as exc:
            raise type(exc)(f"{instruction.where()}: {exc.message}") from None

    # -- one instruction --------------------------------------------------

    async def _instruction(
        self,
        instruction: Instruction,
        state: _StageState,
        context: BuildContext,
        global_args: dict[str, str],
    ) -> None:
        keyword = instruction.keyword
        value = instruction.value
        if substitutes(keyword):
            value = substitute(value, state.variables(), instruction.escape)
        if keyword == "RUN":
            await self._run(instruction, state)
            return
        if keyword in ("COPY", "ADD"):
            await self._copy(instruction, parse_copy(instruction, value), value, state, context)
            return
        self._announce(instruction, cached=None)
        config = state.config
        if keyword == "ARG":
            declared = substitute(instruction.value, state.variables(), instruction.escape)
            for key, default in key_values(instruction, declared).items():
                state.args[key] = self._request.build_args.get(key, default or global_args.get(key, ""))
        elif keyword == "ENV":
            config.env = {**config.env, **key_values(instruction, value)}
        elif keyword == "LABEL":
            config.labels = {**config.labels, **key_values(instruction, value)}
        elif keyword == "WORKDIR":
            config.working_dir = posixpath.normpath(posixpath.join(config.working_dir or "/", value))
            state.workdir_made = False
        elif keyword == "USER":
            config.user = value
        elif keyword == "ENTRYPOINT":
            config.entrypoint, config.cmd = argv(instruction, state.shell), None  # as Docker: a base's CMD goes
        elif keyword == "CMD":
            config.cmd = argv(instruction, state.shell)
        elif keyword == "EXPOSE":
            ports = {port if "/" in port else f"{port}/tcp" for port in value.split()}
            config.exposed_ports = sorted({*config.exposed_ports, *ports})
        elif keyword == "SHELL":
            state.shell = json_array(instruction)
        elif keyword in IGNORED_INSTRUCTIONS:
            self._progress(f"  {keyword} has no effect on a Corral image: ignored")

    def _announce(self, instruction: Instruction, *, cached: bool | None) -> None:
        self._step += 1
        mark = " (cached)" if cached else ""
        self._emit(BuildEvent(type="progress", message=f"Step {self._step}/{self._steps} : {instruction.text}{mark}",
                              step=self._step, steps=self._steps, cached=cached))  # fmt: skip

    def _cached(self, instruction: Instruction, state: _StageState, inputs: dict[str, Any]) -> str | None:
        """The cache key of a layer step; if it was built before, the stack moves on and the step is announced."""
        key = input_key({"builder": "dockerfile", "parents": state.stack, **inputs})
        hit = None if self._request.no_cache else self._catalogue.cached_build(key)
        self._announce(instruction, cached=hit is not None)
        if hit is None:
            self._all_cached = False
            return key
        state.stack = list(hit[0])
        state.workdir_made = True  # the step's sandbox made it when it ran
        return None

    def _remember(self, key: str, state: _StageState, layer_digest: str) -> None:
        state.stack = [*state.stack, layer_digest]
        self._catalogue.remember_build(key, state.stack)

    # -- RUN ------------------------------------------------------------

    async def _run(self, instruction: Instruction, state: _StageState) -> None:
        command = argv(instruction, state.shell)
        env = state.variables()
        inputs = {"run": command, "env": env, "user": state.config.user, "workdir": state.config.working_dir,
                  "network": self._request.network.model_dump() if self._request.network else None}  # fmt: skip
        key = self._cached(instruction, state, inputs)
        if key is None:
            return
        if not state.stack:
            raise InvalidRequest(f"{instruction.where()}: RUN needs a base image with a shell; FROM scratch has none")
        async with self._sandbox(state, env=env, network=self._request.network) as sandbox_id:
            step = ExecRequest(cmd=command, cwd=state.config.working_dir, user=state.config.user,
                               timeout_s=self._request.timeout_s)  # fmt: skip
            await self._images.run_step(sandbox_id, step, instruction.where(), self._progress)
            layer = await self._images.pack_sandbox(
                sandbox_id, state.stack, kind="diff", source={"builder": "dockerfile", "step": instruction.text},
                progress=self._progress,
            )  # fmt: skip
        self._remember(key, state, layer.digest)

    @contextlib.asynccontextmanager
    async def _sandbox(
        self, state: _StageState, *, env: dict[str, str], network: NetworkPolicy | None = None
    ) -> AsyncIterator[str]:
        """A builder sandbox on the stage's stack, its working directory made (so the directory of a WORKDIR
        lands in the next step's layer, as in Docker)."""
        workdir = state.config.working_dir
        async with self._images.builder_sandbox(
            state.stack, label=self._request.name, env=env, network=network, ttl_s=_STEP_TTL_S
        ) as sandbox_id:
            if workdir:
                await self._sandboxes.call(sandbox_id, lambda edge: edge.mkdir(sandbox_id, workdir, True, 0o755))
                state.workdir_made = True
            yield sandbox_id

    async def _make_workdir(self, state: _StageState, stage: Stage) -> None:
        """A stage that ends on a WORKDIR no later step made: make it, so commands can start there."""
        if state.workdir_made or not state.stack:
            return
        inputs = {"workdir": state.config.working_dir}
        key = input_key({"builder": "dockerfile", "parents": state.stack, **inputs})
        hit = None if self._request.no_cache else self._catalogue.cached_build(key)
        if hit is not None:
            state.stack = list(hit[0])
            return
        self._progress(f"  making WORKDIR {state.config.working_dir} (stage {stage.name or stage.index})")
        async with self._sandbox(state, env={}) as sandbox_id:
            layer = await self._images.pack_sandbox(
                sandbox_id, state.stack, kind="diff", source={"builder": "dockerfile", "workdir": inputs["workdir"]},
                progress=self._progress,
            )  # fmt: skip
        self._remember(key, state, layer.digest)

    # -- COPY and ADD -----------------------------------------------------

    async def _copy(
        self,
        instruction: Instruction,
        args: CopyArgs,
        value: str,
        state: _StageState,
        context: BuildContext,
    ) -> None:
        dest = posixpath.normpath(posixpath.join(state.config.working_dir or "/", args.dest))
        into_dir = args.dest.endswith("/") or len(args.sources) > 1 or any(c in "".join(args.sources) for c in "*?[")
        inputs: dict[str, Any] = {"copy": instruction.keyword, "args": value, "workdir": state.config.working_dir}
        source_stack: list[str] | None = None
        if args.from_stage is not None:
            earlier = self._earlier_stage(args.from_stage)
            if earlier is not None:
                source_stack = earlier.stack
            else:
                source_stack = list((await self._image(args.from_stage, instruction)).layers)
            inputs["from"] = source_stack
            sources: list[Path] = []
        else:
            sources = context.sources(instruction, args.sources)
            inputs["files"] = await asyncio.to_thread(
                sources_digest, context.root, [context.walk(source) for source in sources]
            )
            into_dir = into_dir or len(sources) > 1
        key = self._cached(instruction, state, inputs)
        if key is None:
            return
        keep_source_owners = source_stack is not None
        with self._images.scratch("copy-from-") as fetched:
            if source_stack is not None:
                sources = await self._fetch(instruction, source_stack, args.sources, fetched)
                walks = [walk_all(source) for source in sources]
            else:
                walks = [context.walk(source) for source in sources]
            if not state.stack:
                into = dest if into_dir or sources[0].is_dir() else posixpath.dirname(dest)
                chown = numeric_owner(instruction, args.chown, None, None) if args.chown else None
                archive = _archive(instruction, args, sources, walks, dest, into, chown=chown,
                                   keep_source_owners=keep_source_owners, created=into != "/")  # fmt: skip
                layer = await asyncio.to_thread(
                    self._images.build_layer_tree, lambda tree: _extract_under(tree, into, archive), kind="base",
                    parents=(), source={"builder": "dockerfile", "step": instruction.text}, progress=self._progress,
                )  # fmt: skip
                self._remember(key, state, layer.digest)
                return
            async with self._sandbox(state, env={}) as sandbox_id:
                if not into_dir and not sources[0].is_dir():
                    into_dir = await self._file_type(sandbox_id, dest) == "dir"
                into = dest if into_dir or sources[0].is_dir() else posixpath.dirname(dest)
                created = await self._file_type(sandbox_id, into) is None
                chown = await self._owner(instruction, sandbox_id, args.chown) if args.chown else None
                archive = _archive(instruction, args, sources, walks, dest, into, chown=chown,
                                   keep_source_owners=keep_source_owners, created=created)  # fmt: skip
                # Owners and setuid/setgid bits as the archive says: this is image content, not an API upload.
                await self._sandboxes.call(
                    sandbox_id, lambda edge: edge.upload_tar(sandbox_id, into, archive, keep_owners=True)
                )
                layer = await self._images.pack_sandbox(
                    sandbox_id, state.stack, kind="diff", source={"builder": "dockerfile", "step": instruction.text},
                    progress=self._progress,
                )  # fmt: skip
        self._remember(key, state, layer.digest)

    async def _owner(self, instruction: Instruction, sandbox_id: str, chown: str) -> tuple[int, int]:
        """--chown's uid and gid, names looked up in the image's own /etc/passwd and /etc/group."""
        user, _, group = chown.partition(":")

        async def table(path: str, name: str) -> str | None:
            if not name or name.isdigit():
                return None
            try:
                data = await self._sandboxes.call(sandbox_id, lambda edge: edge.read_file(sandbox_id, path))
            except NotFound:
                return None
            return data.decode(errors="replace")

        return numeric_owner(instruction, chown, await table("/etc/passwd", user), await table("/etc/group", group))

    async def _file_type(self, sandbox_id: str, path: str) -> str | None:
        """ "file", "dir", "symlink" or "other" at ``path`` in the sandbox; None if nothing is there."""
        try:
            info = await self._sandboxes.call(sandbox_id, lambda edge: edge.stat(sandbox_id, path))
        except NotFound:
            return None
        return info.type

    async def _fetch(
        self, instruction: Instruction, stack: list[str], paths: tuple[str, ...], dest: Path
    ) -> list[Path]:
        """COPY --from: the source paths out of a sandbox on the other stage's (or image's) layers."""
        if any(c in "".join(paths) for c in "*?["):
            raise InvalidRequest(f"{instruction.where()}: COPY --from takes paths, not globs")
        fetched = []
        async with self._images.builder_sandbox(stack, label="dockerfile:copy-from", env={}, network=None,
                                                ttl_s=_STEP_TTL_S) as sandbox_id:  # fmt: skip
            for number, path in enumerate(paths):
                absolute = posixpath.normpath(posixpath.join("/", path))
                try:
                    data = await self._sandboxes.call(
                        sandbox_id,
                        lambda edge: edge.download_tar(sandbox_id, absolute),  # noqa: B023 - awaited here
                    )
                except NotFound:
                    raise NotFound(f"{instruction.where()}: {absolute} is not in the source stage") from None
                holder = dest / str(number)
                holder.mkdir()
                await asyncio.to_thread(_extract_bytes, data, holder)
                fetched.append(holder / (posixpath.basename(absolute) or "."))
        return fetched


def _archive(
    instruction: Instruction, args: CopyArgs, sources: list[Path], walks: list[Any], dest: str, into: str, *,
    chown: tuple[int, int] | None, keep_source_owners: bool, created: bool,
) -> bytes:  # fmt: skip
    """The tar of one COPY/ADD, relative to ``into`` (which it owns too if --chown and this step makes it)."""
    archive = CopyArchive(chown=chown, keep_source_owners=keep_source_owners, chmod=args.chmod)
    if chown is not None and created:
        archive.add_directory()
    for source, walked in zip(sources, walks, strict=True):
        if source.is_dir() and not source.is_symlink():
            archive.add_tree(walked, source, "")
        elif instruction.keyword == "ADD" and is_local_archive(source):
            archive.add_archive(source)
        else:
            archive.add_tree(walked, source, source.name if into == dest else posixpath.basename(dest))
    return archive.close()


def _extract_under(tree: Path, into: str, archive: bytes) -> None:
    """The first layer of a scratch stage: the archive unpacked at ``into`` in a fresh tree (owners kept)."""
    tree.chmod(0o755)  # the image's "/"
    target = tree / into.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    _extract_bytes(archive, target)


def _extract_bytes(data: bytes, dest: Path) -> None:
    extract_tar(io.BytesIO(data), dest, max_bytes=_ARCHIVE_MAX_BYTES)
