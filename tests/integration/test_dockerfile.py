"""Dockerfile builds against a real server: RUN and COPY in real crun builder sandboxes, the build
context with its .dockerignore, multi-stage builds, the per-step cache, failures that name their
line, and the image config (env, WORKDIR, USER) applied to the sandboxes created from the result."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import REPO
from tests.terminal import run_in_terminal

MULTI_STAGE = """\
ARG BASE=busybox
FROM ${BASE} AS builder
ARG GREETING=hello
ENV APP_HOME=/opt/app
WORKDIR $APP_HOME
COPY --chown=1000:1000 src/*.txt ./
COPY conf/ conf/
ADD bundle.tar.gz unpacked/
RUN echo "$GREETING from $APP_HOME" > built.txt && stat -c %u:%g a.txt > owner.txt

FROM busybox
ENV MODE=prod
COPY --from=builder --chown=user:user /opt/app /srv/app
COPY . /ctx/
WORKDIR /srv/app
USER user
LABEL purpose=test
EXPOSE 8080
CMD ["cat", "built.txt"]
RUN echo first > last.txt
"""
_LAYER_STEP = re.compile(r"^Step \d+/\d+ : (RUN|COPY|ADD)\b")


def _context(root: Path, dockerfile: str, files: dict[str, str]) -> Path:
    for name, text in {"Dockerfile": dockerfile, **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _bundle(path: Path) -> None:
    data = b"from the tarball\n"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("inner.txt")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))


def _layer_steps_run(lines: list[str]) -> list[str]:
    return [line for line in lines if _LAYER_STEP.match(line) and not line.endswith("(cached)")]


def test_multi_stage_build_sandbox_and_cache(client: corral.Client, tmp_path: Path) -> None:
    context = _context(tmp_path / "ctx", MULTI_STAGE, {
        "src/a.txt": "a\n", "src/b.txt": "b\n", "src/secret.txt": "hidden\n", "src/notes.md": "not a .txt\n",
        "conf/app.conf": "k=v\n", "debug.log": "noise\n", ".dockerignore": "src/secret.txt\n*.log\nDockerfile\n",
    })  # fmt: skip
    _bundle(context / "bundle.tar.gz")
    lines: list[str] = []
    started = time.monotonic()
    image = client.images.build_dockerfile(
        "df-app:1", context / "Dockerfile", build_args={"GREETING": "bonjour"}, on_progress=lines.append
    )
    first_build_s = time.monotonic() - started
    steps = [line for line in lines if line.startswith("Step ")]
    assert steps[0] == "Step 1/18 : FROM ${BASE} AS builder" and steps[-1] == "Step 18/18 : RUN echo first > last.txt"
    assert len(_layer_steps_run(lines)) == 7  # every COPY, ADD and RUN ran: nothing was cached yet

    config = client.images.inspect(image.name).config
    assert config.env["MODE"] == "prod" and config.working_dir == "/srv/app" and config.user == "user"
    assert config.cmd == ["cat", "built.txt"] and config.labels == {"purpose": "test"}
    assert config.exposed_ports == ["8080/tcp"]
    with client.create(image.name) as sandbox:
        assert sandbox.exec("pwd; id -u; echo $MODE").stdout == "/srv/app\n1000\nprod\n"
        assert sandbox.exec("cat built.txt owner.txt last.txt").stdout == "bonjour from /opt/app\n1000:1000\nfirst\n"
        listing = sandbox.exec("ls /srv/app /srv/app/conf /srv/app/unpacked").stdout.split()
        assert {"a.txt", "b.txt", "app.conf", "inner.txt"} <= set(listing)
        assert "secret.txt" not in listing and "notes.md" not in listing
        assert sandbox.exec("cat unpacked/inner.txt").stdout == "from the tarball\n"
        assert sandbox.exec("stat -c %u:%g /srv/app/a.txt /srv/app/last.txt").stdout == "1000:1000\n1000:1000\n"
        assert sandbox.exec("ls -a /ctx/src; test -e /ctx/debug.log").stdout.split() == [".", "..", "a.txt", "b.txt",
                                                                                          "notes.md"]  # fmt: skip
    with client.create(image.name, cwd="/", user="root", env={"MODE": "dev"}) as sandbox:
        assert sandbox.exec("pwd; id -u; echo $MODE").stdout == "/\n0\ndev\n"  # the request's own win

    (context / "Dockerfile").write_text(MULTI_STAGE.replace("echo first", "echo second"))
    lines.clear()
    started = time.monotonic()
    rebuilt = client.images.build_dockerfile(
        "df-app:2", context / "Dockerfile", build_args={"GREETING": "bonjour"}, on_progress=lines.append
    )
    rebuild_s = time.monotonic() - started
    print(f"dockerfile build: first {first_build_s:.2f} s, after editing the last line {rebuild_s:.2f} s")
    assert _layer_steps_run(lines) == ["Step 18/18 : RUN echo second > last.txt"]
    assert rebuild_s <= 0.6 * first_build_s  # docs/spec.md: one step of seven reruns
    assert rebuilt.layers[:-1] == image.layers[:-1] and rebuilt.layers[-1] != image.layers[-1]
    with client.create(rebuilt.name) as sandbox:
        assert sandbox.exec("cat last.txt").stdout == "second\n"


def test_failing_run_names_its_line_with_output(client: corral.Client, tmp_path: Path) -> None:
    dockerfile = (
        "FROM busybox AS ok\n"
        "RUN echo fine > /fine\n"
        "FROM ok\n"
        'SHELL ["/bin/sh", "-ec"]\n'
        "RUN echo the reason is here >&2; false; echo never\n"
    )
    context = _context(tmp_path, dockerfile, {})
    lines: list[str] = []
    client.images.build_dockerfile("df-target", context / "Dockerfile", target="ok", on_progress=lines.append)
    assert [line for line in lines if line.startswith("Step ")] == ["Step 1/2 : FROM busybox AS ok",
                                                                    "Step 2/2 : RUN echo fine > /fine"]  # fmt: skip
    with pytest.raises(
        corral.InvalidRequest, match=r"(?s)line 5: RUN echo the reason is here.*exit 1.*the reason"
    ) as e:
        client.images.build_dockerfile("df-broken", context / "Dockerfile")
    assert e.value.message.endswith("its last output:\nthe reason is here")  # SHELL's -e stopped it at `false`
    assert "df-broken:latest" not in {image.name for image in client.images.list()}
    assert client.list(labels={"corral.builder": "df-broken"}) == []


def test_refusals_are_clear(client: corral.Client, tmp_path: Path) -> None:
    cases = {
        "FROM ns/img:1\n": r"line 1: FROM ns/img:1: ",  # no host first: a Corral name, and not a valid one
        "FROM busybox\nADD http://example.invalid/x /x\n": r"line 2: ADD .*URL is not supported",
        "FROM busybox\nONBUILD RUN true\n": r"line 2: ONBUILD .*not supported",
        "FROM scratch\nRUN true\n": r"line 2: RUN true: RUN needs a base image with a shell",
    }
    for number, (dockerfile, message) in enumerate(cases.items()):
        context = _context(tmp_path / str(number), dockerfile, {})
        with pytest.raises(corral.InvalidRequest, match=message):
            client.images.build_dockerfile("df-refused", context / "Dockerfile")
    with socket.socket() as closed:  # bound but not listening: a registry that refuses the connection
        closed.bind(("127.0.0.1", 0))
        ref = f"127.0.0.1:{closed.getsockname()[1]}/ns/img:1"
        context = _context(tmp_path / "registry", f"FROM {ref}\n", {})
        with pytest.raises(corral.ServerUnavailable, match=f"line 1: FROM {ref}: cannot connect to registry"):
            client.images.build_dockerfile("df-refused", context / "Dockerfile")


def test_cli_scratch_with_copy_from_a_stage(server: EmbeddedServer, tmp_path: Path) -> None:
    dockerfile = (
        "FROM busybox AS tools\n"
        "FROM scratch\n"
        "COPY --from=tools /bin/busybox /bin/busybox\n"
        "COPY hello.txt /greeting/\n"
        "ENV GREETING_DIR=/greeting\n"
    )
    context = _context(tmp_path, dockerfile, {"hello.txt": "hi from scratch\n"})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral.cli.main", *args], env=server.env(), cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    built = cli("images", "build", "df-scratch", "--dockerfile", str(context / "Dockerfile"))
    assert built.returncode == 0, built.stderr
    assert "Step 3/5 : COPY --from=tools /bin/busybox /bin/busybox" in built.stdout
    assert "━" not in built.stdout and "\x1b" not in built.stdout, "piped output gets plain lines, no progress bar"
    assert "built df-scratch:latest: 2 layers" in built.stdout
    again = cli("images", "build", "df-scratch", "--dockerfile", str(context / "Dockerfile"))
    assert again.returncode == 0 and "COPY hello.txt /greeting/ (cached)" in again.stdout, again.stdout
    rebuilt = cli("images", "build", "df-scratch", "--dockerfile", str(context / "Dockerfile"), "--no-cache")
    assert rebuilt.returncode == 0, rebuilt.stderr  # a flag: typer once offered it as --no-cache/--no-no-cache
    assert "(cached)" not in rebuilt.stdout and "built df-scratch:latest: 2 layers" in rebuilt.stdout
    assert (
        'config: {"env": {"GREETING_DIR": "/greeting"}, "user": "0"}' in cli("images", "inspect", "df-scratch").stdout
    )
    with server.client() as client, client.create("df-scratch") as sandbox:
        result = sandbox.exec(["/bin/busybox", "sh", "-c", "cat $GREETING_DIR/hello.txt; /bin/busybox ls /"])
        assert result.stdout.split("\n", 1)[0] == "hi from scratch", result
        assert "bin" in result.stdout and "greeting" in result.stdout


def test_cli_build_in_a_terminal_shows_a_progress_bar(server: EmbeddedServer, tmp_path: Path) -> None:
    """In a terminal `corral images build --dockerfile` draws a bar (steps done of all, the current step, the time
    taken) under the step lines; piped, the lines alone (test_cli_scratch_with_copy_from_a_stage)."""
    context = _context(tmp_path, "FROM busybox\nRUN sleep 1 && echo one > /one\nRUN sleep 1\nENV BAR=1\n", {})
    command = [sys.executable, "-m", "corral.cli.main", "images", "build", "df-bar", "--dockerfile",
               str(context / "Dockerfile"), "--no-cache"]  # fmt: skip
    code, plain = run_in_terminal(command, server.env(), REPO, timeout_s=120)
    assert code == 0, plain[-3000:]
    assert "Step 2/4 : RUN sleep 1 && echo one > /one" in plain and "built df-bar:latest" in plain
    drawn = re.findall(r"building df-bar [━╺╸]+ (\d)/4 (\d+:\d\d:\d\d) (.+?)(?=building df-bar|Step |\r|\n|$)", plain)
    assert drawn, plain[-3000:]
    shown = {(done, step.strip()) for done, _, step in drawn}
    assert {("1", "RUN sleep 1 && echo one > /one"), ("2", "RUN sleep 1"), ("3", "ENV BAR=1")} <= shown, shown
    assert max(elapsed for _, elapsed, _ in drawn) >= "0:00:01", drawn  # the clock ran with the build


def test_escape_directive_backtick(client: corral.Client, tmp_path: Path) -> None:
    """``# escape=``` (Windows-style): a backtick continues lines and escapes ``$``; backslashes are plain."""
    dockerfile = (
        "# escape=`\n"
        "FROM busybox\n"
        "ENV WINPATH=C:\\Tools\\bin PRICE=`$5\n"
        'RUN printf \'%s\\n\' "$WINPATH" "$PRICE" > /out.txt && `\n'
        "    echo continued >> /out.txt\n"
        "LABEL note=C:\\notes\\\n"
        "WORKDIR /srv\n"  # with a backslash escape, the LABEL's trailing backslash would have swallowed this line
    )
    context = _context(tmp_path, dockerfile, {})
    lines: list[str] = []
    image = client.images.build_dockerfile("df-escape", context / "Dockerfile", on_progress=lines.append)
    assert 'Step 3/5 : RUN printf \'%s\\n\' "$WINPATH" "$PRICE" > /out.txt && echo continued >> /out.txt' in lines
    config = client.images.inspect(image.name).config
    assert (config.env["WINPATH"], config.env["PRICE"]) == ("C:\\Tools\\bin", "$5")
    assert config.labels == {"note": "C:\\notes\\"} and config.working_dir == "/srv"
    with client.create(image.name) as sandbox:
        assert sandbox.exec("cat /out.txt; pwd").stdout == "C:\\Tools\\bin\n$5\ncontinued\n/srv\n"


def _owned_tar(path: Path, owner: tuple[int, int]) -> None:
    """A tar whose members belong to ``owner``: a setuid file (4750) in a directory, as an image tarball has."""
    data = b"#!/bin/sh\necho from the tar\n"
    with tarfile.open(path, "w") as tar:
        for name, kind, mode in (("dir", tarfile.DIRTYPE, 0o750), ("dir/suid-in-tar", tarfile.REGTYPE, 0o4750)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, (info.uid, info.gid) = kind, mode, owner
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


COPY_MODES = """\
FROM busybox AS stage
RUN mkdir /out && echo x > /out/owned && chown 1001:1002 /out/owned && cp /bin/busybox /out/su && chmod 4755 /out/su
FROM busybox
COPY bin/ /opt/bin/
COPY tree /tree
COPY --chown=user:user bin/tool /opt/as-user/
COPY --chown=4321 bin/tool /opt/numeric/tool
COPY --from=stage /out /from-stage
COPY --from=stage --chown=7:8 /out/owned /from-stage-chowned
ADD bundle.tar /unpacked/
ADD --chown=99:98 bundle.tar /unpacked-chowned/
"""


def test_copy_and_add_keep_modes_and_owners_as_docker(client: corral.Client, tmp_path: Path) -> None:
    """Setuid, setgid and sticky bits survive COPY and ADD; owners are root's for context files, the source's
    for COPY --from and a local tar's ADD, and --chown's (names from the image's /etc/passwd and /etc/group)."""
    context = _context(tmp_path, COPY_MODES, {"bin/tool": "#!/bin/sh\necho tool\n", "bin/shared": "shared\n"})
    for name, mode in (("bin/tool", 0o4755), ("bin/shared", 0o2775)):
        os.chown(context / name, 1500, 1500)  # a context file's owner on the server's machine is not kept
        os.chmod(context / name, mode)  # after chown, which clears the setuid and setgid bits
    (context / "tree/tmp").mkdir(parents=True)
    (context / "tree/tmp").chmod(0o1777)
    _owned_tar(context / "bundle.tar", (1234, 2345))
    image = client.images.build_dockerfile("df-modes", context / "Dockerfile")
    paths = ["/opt/bin/tool", "/opt/bin/shared", "/tree/tmp", "/opt/as-user", "/opt/as-user/tool", "/opt/numeric/tool",
             "/from-stage/owned", "/from-stage/su", "/from-stage-chowned", "/unpacked/dir", "/unpacked/dir/suid-in-tar",
             "/unpacked-chowned/dir", "/unpacked-chowned/dir/suid-in-tar"]  # fmt: skip
    with client.create(image.name) as sandbox:
        result = sandbox.exec(["stat", "-c", "%n %a %u:%g", *paths])
        assert result.exit_code == 0, result
        assert result.stdout.splitlines() == [
            "/opt/bin/tool 4755 0:0",  # the setuid binary keeps 4755
            "/opt/bin/shared 2775 0:0",
            "/tree/tmp 1777 0:0",  # sticky (a copied directory's contents; /tree itself is made 755, as Docker)
            "/opt/as-user 755 1000:1000",  # made by this COPY --chown: the user's too
            "/opt/as-user/tool 4755 1000:1000",  # --chown keeps the setuid bit (chown(2) would clear it)
            "/opt/numeric/tool 4755 4321:4321",  # a UID without GID: the same number as GID
            "/from-stage/owned 644 1001:1002",  # COPY --from keeps the source stage's owners ...
            "/from-stage/su 4755 0:0",
            "/from-stage-chowned 644 7:8",  # ... unless --chown
            "/unpacked/dir 750 1234:2345",  # a local tar's owners and modes, as the tar says
            "/unpacked/dir/suid-in-tar 4750 1234:2345",
            "/unpacked-chowned/dir 750 99:98",
            "/unpacked-chowned/dir/suid-in-tar 4750 99:98",
        ]
        assert sandbox.exec("/opt/bin/tool").stdout == "tool\n"
    context_bad = _context(tmp_path / "bad", "FROM busybox\nCOPY --chown=nobody-here x /x\n", {"x": "x\n"})
    with pytest.raises(corral.InvalidRequest, match="line 2: COPY --chown=nobody-here x /x: --chown: no user "
                       "'nobody-here' in the image's /etc/passwd"):  # fmt: skip
        client.images.build_dockerfile("df-modes-bad", context_bad / "Dockerfile")
