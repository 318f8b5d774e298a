"""Dockerfiles read into build stages: instructions, Docker's variable substitution, the build
context with its .dockerignore, and the archives that COPY and ADD put into an image.

The file's structure (continuation lines, comments, instruction boundaries) comes from
dockerfile-parse; this module gives each instruction its arguments and meaning. The ``# escape=``
parser directive (`` ` `` in Windows-style Dockerfiles, so a ``C:`` path keeps its backslashes)
is honoured by dockerfile-parse for continuation lines only; the character it names is read here
too and kept with each instruction, since Docker also escapes ``$`` and quotes with it (ENV,
LABEL, ARG ...). Nothing here runs a sandbox: corral/gateway/dockerfile_build.py executes the
stages. Every step's cache key is built from what this module computes: the instruction after
substitution and, for COPY and ADD, a digest of the copied files' names, modes and bytes (never
their mtimes, so a touched file stays cached).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import stat
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pathspec
from dockerfile_parse import DockerfileParser

from corral.api.errors import InvalidRequest, NotFound

__all__ = [
    "LAYER_INSTRUCTIONS",
    "numeric_owner",
    "BuildContext",
    "CopyArgs",
    "Dockerfile",
    "Instruction",
    "Stage",
    "key_values",
    "parse_copy",
    "parse_dockerfile",
    "substitute",
]

LAYER_INSTRUCTIONS = frozenset({"RUN", "COPY", "ADD"})
_METADATA_INSTRUCTIONS = frozenset({"ENV", "ARG", "WORKDIR", "USER", "ENTRYPOINT", "CMD", "LABEL", "EXPOSE", "SHELL"})
# Accepted and ignored: they say nothing a sandbox uses (health checks, stop signals, volumes, authors).
IGNORED_INSTRUCTIONS = frozenset({"MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME"})
MAX_DOCKERFILE_BYTES = 1 << 20
_SUBSTITUTED = frozenset({"ADD", "COPY", "ENV", "EXPOSE", "FROM", "LABEL", "USER", "WORKDIR"})
_VARIABLE = (
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:[-+])(?P<word>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)
# By escape character: that character before "$" makes a dollar, else "$" starts a variable.
_VARIABLES = {escape: re.compile(re.escape(escape) + r"\$|" + _VARIABLE) for escape in ("\\", "`")}
_COPY_FLAGS = {"COPY": frozenset({"from", "chown", "chmod"}), "ADD": frozenset({"chown", "chmod"})}
DEFAULT_ESCAPE = "\\"
# Parser directives, as dockerfile-parse reads them: only at the top, before any other line.
_DIRECTIVE = re.compile(r"^\s*#\s*(?P<name>escape|syntax)\s*=\s*(?P<value>.*?)\s*$", re.IGNORECASE)
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Instruction:
    line: int  # the first line it is on, from 1
    keyword: str  # upper case
    value: str  # its arguments as written (continuations joined)
    text: str  # the instruction as written, for messages
    escape: str = DEFAULT_ESCAPE  # the file's escape character (its ``# escape=`` directive)

    def where(self) -> str:
        return f"Dockerfile line {self.line}: {self.text}"


@dataclass(frozen=True)
class Stage:
    index: int
    name: str | None  # FROM ... AS name, lower case
    base: str  # FROM's image, before substitution
    from_instruction: Instruction
    body: tuple[Instruction, ...]


@dataclass(frozen=True)
class Dockerfile:
    global_args: tuple[Instruction, ...]  # ARGs before the first FROM: usable in FROM lines
    stages: tuple[Stage, ...]

    def stage(self, ref: str, before: int) -> Stage | None:
        """The stage ``ref`` (a name or an index) names, among those before stage ``before``; None if none."""
        for stage in self.stages[:before]:
            if stage.name == ref.lower() or str(stage.index) == ref:
                return stage
        return None

    def needed(self, target: str | None) -> list[Stage]:
        """The stages a build of ``target`` (default: the last stage) runs, in order: it and what it uses."""
        last = self.stages[-1]
        if target is not None:
            found = self.stage(target, len(self.stages))
            if found is None:
                names = ", ".join(s.name for s in self.stages if s.name) or "none"
                raise InvalidRequest(f"target stage {target!r} is not in the Dockerfile (stages named: {names})")
            last = found
        wanted = {last.index}
        for stage in reversed(self.stages[: last.index + 1]):
            if stage.index not in wanted:
                continue
            refs = [stage.base] + [parse_copy(i).from_stage or "" for i in stage.body if i.keyword == "COPY"]
            for ref in refs:
                used = self.stage(ref, stage.index) if ref else None
                if used is not None:
                    wanted.add(used.index)
        return [stage for stage in self.stages if stage.index in wanted]


@dataclass(frozen=True)
class CopyArgs:
    sources: tuple[str, ...]
    dest: str
    from_stage: str | None = None
    chown: str | None = None
    chmod: int | None = None


def parse_dockerfile(text: str) -> Dockerfile:
    """Stages and instructions of a Dockerfile; refuses instructions Corral does not build."""
    if len(text.encode()) > MAX_DOCKERFILE_BYTES:
        raise InvalidRequest(f"the Dockerfile is over {MAX_DOCKERFILE_BYTES} bytes")
    escape = _escape_directive(text)
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False)
    global_args: list[Instruction] = []
    stages: list[Stage] = []
    body: list[Instruction] = []
    for item in parser.structure:
        keyword = str(item["instruction"]).upper()
        if keyword == "COMMENT":
            continue
        instruction = Instruction(
            line=int(item["startline"]) + 1, keyword=keyword, value=str(item["value"]).strip(),
            text=" ".join(str(item["content"]).replace(escape + "\n", " ").split()), escape=escape,
        )  # fmt: skip
        if keyword == "FROM":
            if stages:
                stages[-1] = _with_body(stages[-1], body)
            body = []
            stages.append(_stage(instruction, len(stages)))
        elif not stages:
            if keyword != "ARG":
                raise InvalidRequest(f"{instruction.where()}: only ARG may come before the first FROM")
            global_args.append(instruction)
        elif keyword in LAYER_INSTRUCTIONS | _METADATA_INSTRUCTIONS | IGNORED_INSTRUCTIONS:
            body.append(instruction)
        else:
            raise InvalidRequest(f"{instruction.where()}: {keyword} is not supported by Corral's Dockerfile builds")
    if not stages:
        raise InvalidRequest("the Dockerfile has no FROM instruction")
    stages[-1] = _with_body(stages[-1], body)
    return Dockerfile(global_args=tuple(global_args), stages=tuple(stages))


def _escape_directive(text: str) -> str:
    """The character ``# escape=`` names at the top of the file (``\\`` or `` ` ``), else the default backslash."""
    escape = DEFAULT_ESCAPE
    for number, line in enumerate(text.splitlines(), 1):
        directive = _DIRECTIVE.match(line)
        if directive is None:
            break
        if directive["name"].lower() == "escape":
            if directive["value"] not in ("\\", "`"):
                raise InvalidRequest(
                    f"Dockerfile line {number}: {line.strip()}: the escape directive takes \\ or ` only"
                )
            escape = directive["value"]
    return escape


def _stage(instruction: Instruction, index: int) -> Stage:
    flags, rest = _split_flags(instruction)
    if flags:
        raise InvalidRequest(f"{instruction.where()}: FROM --{next(iter(flags))} is not supported")
    words = rest.split()
    if len(words) == 3 and words[1].lower() == "as":
        return Stage(index=index, name=words[2].lower(), base=words[0], from_instruction=instruction, body=())
    if len(words) != 1:
        raise InvalidRequest(f"{instruction.where()}: expected FROM image [AS name]")
    return Stage(index=index, name=None, base=words[0], from_instruction=instruction, body=())


def _with_body(stage: Stage, body: list[Instruction]) -> Stage:
    return Stage(stage.index, stage.name, stage.base, stage.from_instruction, tuple(body))


def substitute(text: str, variables: Mapping[str, str], escape: str = DEFAULT_ESCAPE) -> str:
    """Docker's ``$NAME``, ``${NAME}``, ``${NAME:-default}`` and ``${NAME:+alternative}``; the escape character
    before ``$`` (``\\$``, or `` `$ `` after ``# escape=` ``) is a dollar."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == escape + "$":
            return "$"
        name = match.group("braced") or match.group("bare")
        value = variables.get(name, "")
        op = match.group("op")
        if op == ":-":
            return value or substitute(match.group("word"), variables, escape)
        if op == ":+":
            return substitute(match.group("word"), variables, escape) if value else ""
        return value

    return _VARIABLES[escape].sub(replace, text)


def substitutes(keyword: str) -> bool:
    """Whether Docker substitutes variables in this instruction's arguments (RUN, CMD ... leave it to the shell)."""
    return keyword in _SUBSTITUTED


def key_values(instruction: Instruction, value: str) -> dict[str, str]:
    """``K=V K2="v 2"`` (or the old ``K V`` form of ENV and LABEL) as a dict, in order."""
    lexer = shlex.shlex(value, posix=True)
    lexer.whitespace_split, lexer.commenters, lexer.escape = True, "", instruction.escape
    try:
        words = list(lexer)
    except ValueError as exc:
        raise InvalidRequest(f"{instruction.where()}: {exc}") from None
    if words and "=" not in words[0]:
        if instruction.keyword == "ARG":
            return {words[0]: ""} if len(words) == 1 else _bad_pairs(instruction)
        return {words[0]: value.split(None, 1)[1].strip() if len(words) > 1 else ""}
    pairs = {}
    for word in words:
        key, sep, item = word.partition("=")
        if not sep or not key:
            _bad_pairs(instruction)
        pairs[key] = item
    return pairs


def _bad_pairs(instruction: Instruction) -> dict[str, str]:
    raise InvalidRequest(f"{instruction.where()}: expected NAME=value pairs")


def _json_words(value: str) -> list[str] | None:
    """The exec form ``["a", "b"]`` as its words; None for anything else (the shell form)."""
    if not value.startswith("["):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    if isinstance(parsed, list) and all(isinstance(word, str) for word in parsed):
        return parsed
    return None


def argv(instruction: Instruction, shell: list[str]) -> list[str]:
    """RUN, CMD and ENTRYPOINT: a JSON array as it is, else the shell form run by ``shell``."""
    words = _json_words(instruction.value)
    return words if words is not None else [*shell, instruction.value]


def json_array(instruction: Instruction) -> list[str]:
    """SHELL's argument: it must be a JSON array of strings."""
    words = _json_words(instruction.value)
    if not words:
        raise InvalidRequest(f'{instruction.where()}: expected a JSON array, e.g. SHELL ["/bin/bash", "-c"]')
    return words


def parse_copy(instruction: Instruction, value: str | None = None) -> CopyArgs:
    """COPY and ADD: flags (--from, --chown, --chmod), sources, destination."""
    flags, rest = _split_flags(instruction, value)
    unknown = set(flags) - _COPY_FLAGS[instruction.keyword]
    if unknown:
        raise InvalidRequest(f"{instruction.where()}: {instruction.keyword} --{sorted(unknown)[0]} is not supported")
    words = _json_words(rest)
    if words is None:
        words = rest.split()
    if len(words) < 2:
        raise InvalidRequest(f"{instruction.where()}: {instruction.keyword} needs a source and a destination")
    chmod = None
    if "chmod" in flags:
        try:
            chmod = int(flags["chmod"], 8)
        except ValueError:
            raise InvalidRequest(f"{instruction.where()}: --chmod takes an octal mode, e.g. 755") from None
    return CopyArgs(sources=tuple(words[:-1]), dest=words[-1], from_stage=flags.get("from"),
                    chown=flags.get("chown"), chmod=chmod)  # fmt: skip


def _split_flags(instruction: Instruction, value: str | None = None) -> tuple[dict[str, str], str]:
    rest = instruction.value if value is None else value
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, flag_value = word[2:].partition("=")
        flags[name.lower()] = flag_value
        rest = rest.lstrip()
    return flags, rest


# -- the build context ---------------------------------------------------


@dataclass
class BuildContext:
    """The directory COPY and ADD read from, less what its .dockerignore excludes."""

    root: Path
    _ignore: pathspec.PathSpec[Any] = field(init=False)
    _negated: bool = field(init=False)

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        if not self.root.is_dir():
            raise NotFound(f"no build context directory {self.root} on the server's machine")
        ignore_file = self.root / ".dockerignore"
        lines = ignore_file.read_text(errors="replace").splitlines() if ignore_file.is_file() else []
        patterns = [_anchored(line.strip()) for line in lines if line.strip() and not line.strip().startswith("#")]
        self._ignore = pathspec.PathSpec.from_lines("gitignore", patterns)
        self._negated = any(pattern.startswith("!") for pattern in patterns)

    def ignored(self, relative: str) -> bool:
        return bool(relative) and self._ignore.match_file(relative)

    def sources(self, instruction: Instruction, patterns: tuple[str, ...]) -> list[Path]:
        """The context paths that COPY/ADD sources (names or globs) select; each must select something."""
        selected: list[Path] = []
        for pattern in patterns:
            if re.match(r"^[a-z][a-z0-9+.-]*://", pattern, re.IGNORECASE):
                raise InvalidRequest(
                    f"{instruction.where()}: {instruction.keyword} of a URL is not supported (builds fetch nothing "
                    "from the network): download it into the build context and COPY it"
                )
            relative = posixpath.normpath(pattern.lstrip("/")) if pattern.strip("/") else "."
            if relative == ".." or relative.startswith("../"):
                raise InvalidRequest(f"{instruction.where()}: {pattern!r} is outside the build context")
            if _GLOB_CHARS.search(relative):
                matches = sorted(self.root.glob(relative))
            else:
                matches = [self.root / relative] if os.path.lexists(self.root / relative) else []
            matches = [path for path in matches if not self.ignored(self._relative(path))]
            for path in matches:  # a symlinked directory on the way must not lead out of the context
                parent = Path(os.path.realpath(path.parent)) if path != self.root else self.root
                if parent != self.root and self.root not in parent.parents:
                    raise InvalidRequest(f"{instruction.where()}: {pattern!r} leads outside the build context")
            if not matches:
                raise NotFound(f"{instruction.where()}: {pattern!r} matches nothing in the build context {self.root}")
            selected += matches
        return selected

    def walk(self, source: Path) -> Iterator[Path]:
        """``source`` and, for a directory, everything below it that is not ignored, parents first, sorted."""
        yield source
        if source.is_dir() and not source.is_symlink():
            for entry in sorted(source.iterdir()):
                relative = self._relative(entry)
                if self.ignored(relative) and not (self._negated and entry.is_dir()):
                    continue  # a negation (!pattern) may re-include something below an ignored directory
                yield from self.walk(entry)

    def _relative(self, path: Path) -> str:
        relative = os.path.relpath(path, self.root)
        return "" if relative == "." else relative


def _anchored(pattern: str) -> str:
    """.dockerignore patterns are relative to the context root, unlike .gitignore's that match at any depth."""
    negated = pattern.startswith("!")
    body = posixpath.normpath(pattern[1:] if negated else pattern).lstrip("/")
    return ("!" if negated else "") + "/" + body


# -- archives of what COPY and ADD add -----------------------------------


def numeric_owner(instruction: Instruction, chown: str, passwd: str | None, group: str | None) -> tuple[int, int]:
    """``--chown=user[:group]`` as (uid, gid): names from the image's /etc/passwd and /etc/group (their texts, None
    if the image has none); a user without a group gets its uid as gid, as Docker does."""
    user, _, group_name = chown.partition(":")
    uid = _id_of(instruction, user, passwd, "user", "/etc/passwd")
    return uid, _id_of(instruction, group_name, group, "group", "/etc/group") if group_name else uid


def _id_of(instruction: Instruction, name: str, table: str | None, what: str, path: str) -> int:
    if name.isdigit():
        return int(name)
    for line in (table or "").splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[0] == name and fields[2].isdigit():
            return int(fields[2])
    where = f"the image's {path}" if table is not None else f"the image, which has no {path}"
    raise InvalidRequest(f"{instruction.where()}: --chown: no {what} {name!r} in {where}; use numbers (UID:GID)")


def sources_digest(root: Path, paths: list[Iterator[Path]]) -> str:
    """A digest of the files COPY/ADD read: names (relative to ``root``), types, modes and bytes, not mtimes."""
    digest = hashlib.sha256()
    for walked in paths:
        for path in walked:
            st = path.lstat()
            digest.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                digest.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
            digest.update(b"\n")
    return "sha256:" + digest.hexdigest()


class CopyArchive:
    """A tar of what one COPY/ADD puts under a directory of the image, with every mode bit of its sources
    (setuid, setgid and sticky included). Owners as Docker gives them: ``chown`` (--chown's numbers) if given;
    else files from the build context are root's, those of another stage (``keep_source_owners``) keep theirs,
    and a local tar's members keep what the tar says."""

    def __init__(self, *, chown: tuple[int, int] | None, keep_source_owners: bool, chmod: int | None) -> None:
        self._buffer = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buffer, mode="w", format=tarfile.PAX_FORMAT)
        self._chown, self._keep_source_owners, self._chmod = chown, keep_source_owners, chmod

    def add_directory(self) -> None:
        """The directory itself (a COPY --chown made it: it is the user's too, as in Docker)."""
        info = tarfile.TarInfo(".")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        info.uid, info.gid = self._chown or (0, 0)
        self._tar.addfile(info)

    def add_tree(self, walked: Iterator[Path], source: Path, name: str) -> None:
        """``source`` (walked parents first) as ``name``; ``""`` puts a directory's contents straight under it."""
        for path in walked:
            relative = os.path.relpath(path, source)
            arcname = posixpath.normpath(posixpath.join(name, relative)) if relative != "." else name
            if not arcname or arcname == ".":
                continue
            info = self._tar.gettarinfo(str(path), arcname)
            if self._chown is not None or not self._keep_source_owners:
                info.uid, info.gid = self._chown or (0, 0)
            info.uname, info.gname = "", ""  # numbers, not the names on the server's machine
            if self._chmod is not None and not info.issym():
                info.mode = self._chmod
            if info.isreg():
                with open(path, "rb") as f:
                    self._tar.addfile(info, f)
            elif info.isdir() or info.issym() or info.islnk():
                self._tar.addfile(info)

    def add_archive(self, archive: Path) -> None:
        """ADD of a local tar (any compression): its members as they are, owned as --chown says if given."""
        with tarfile.open(archive, "r:*") as source:
            for member in source:
                if self._chown is not None:
                    member.uid, member.gid = self._chown
                    member.uname, member.gname = "", ""
                self._tar.addfile(member, source.extractfile(member) if member.isreg() else None)

    def close(self) -> bytes:
        self._tar.close()
        return self._buffer.getvalue()


def walk_all(source: Path) -> Iterator[Path]:
    """``source`` and everything below it, parents first, sorted (a tree with no .dockerignore)."""
    yield source
    if source.is_dir() and not source.is_symlink():
        for entry in sorted(source.iterdir()):
            yield from walk_all(entry)


def is_local_archive(path: Path) -> bool:
    """ADD extracts a local tar (plain, gzip, bzip2, xz) instead of copying it."""
    return stat.S_ISREG(path.lstat().st_mode) and tarfile.is_tarfile(path)
