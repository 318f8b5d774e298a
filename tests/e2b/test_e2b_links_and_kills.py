"""The unmodified e2b SDK against two envd behaviours: symlinks in Stat/ListDir, and a kill while a command streams.

A symlink is reported as envd reports it: its target's type and mode, the
target resolved to an absolute path, ``isSymlink`` on the wire (which e2b 2.63
shows as ``FileType.SYMLINK``). A sandbox killed while ``process.Process/Start``
streams drops the connection, as E2B's proxy does, rather than ending the
stream with an ``unavailable`` frame.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from e2b import FileType, InvalidArgumentException, Sandbox, SandboxException

from corral.embedded import EmbeddedServer
from corral.gateway.e2b.common import frame
from tests.e2b.sdk import SHOWS_SYMLINKS, SandboxGoneError

_LINKS = """
set -e
mkdir -p real/sub
printf hello > real/file.txt
chmod 640 real/file.txt
ln -s /home/user/real/file.txt link-file
ln -s real/file.txt rel-link
ln -s link-file chain
ln -s real link-dir
ln -s link-dir/file.txt via-dir
ln -s link-dir/sub/../file.txt dot-dot
ln -s /nowhere dangling
ln -s cyclic cyclic
"""


@pytest.fixture
def linked(e2b_sandboxes: list) -> Sandbox:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", timeout=300)
    e2b_sandboxes.append(sandbox)
    sandbox.commands.run(_LINKS)
    return sandbox


def _raw_stat(sandbox: Sandbox, path: str) -> dict:  # type: ignore[type-arg]
    """The entry as it is on the wire (the SDK hides ``type`` behind ``isSymlink``)."""
    headers = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token,
        "Content-Type": "application/json",
    }
    url = f"{os.environ['E2B_SANDBOX_URL']}/filesystem.Filesystem/Stat"
    reply = httpx.post(url, headers=headers, json={"path": path})
    assert reply.status_code == 200, reply.text
    return reply.json()["entry"]


def test_stat_of_a_symlink_reports_the_target(linked: Sandbox) -> None:
    info = linked.files.get_info("link-file")
    assert info.type == (FileType.SYMLINK if SHOWS_SYMLINKS else FileType.FILE)  # the SDK's reading of isSymlink
    assert info.symlink_target == "/home/user/real/file.txt"
    assert info.path == "/home/user/link-file" and info.name == "link-file"
    assert info.mode == 0o640 and info.permissions == "Lrwxrwxrwx"  # the target's mode; Go's mode string
    for name in ("rel-link", "chain", "via-dir", "dot-dot"):  # relative, chained, through a link, .. after one
        assert linked.files.get_info(name).symlink_target == "/home/user/real/file.txt", name
    assert linked.files.get_info("link-dir").symlink_target == "/home/user/real"
    wire = _raw_stat(linked, "/home/user/link-file")
    assert wire["type"] == "FILE_TYPE_FILE" and wire["isSymlink"] is True
    assert _raw_stat(linked, "link-dir")["type"] == "FILE_TYPE_DIRECTORY"
    for broken in ("dangling", "cyclic"):  # nothing there: no type, its own path as target
        wire = _raw_stat(linked, broken)
        assert wire["type"] == "FILE_TYPE_UNSPECIFIED" and wire["symlinkTarget"] == f"/home/user/{broken}"
        assert wire["mode"] == 0
    plain = linked.files.get_info("real/file.txt")
    assert plain.type == FileType.FILE and plain.symlink_target is None and plain.permissions == "-rw-r-----"


def test_list_dir_follows_a_link_to_a_directory_but_not_links_inside(linked: Sandbox) -> None:
    inside = linked.files.list("link-dir")
    assert sorted(e.path for e in inside) == ["/home/user/link-dir/file.txt", "/home/user/link-dir/sub"]
    home = {e.name: e for e in linked.files.list("/home/user", depth=2)}
    assert home["link-dir"].type == (FileType.SYMLINK if SHOWS_SYMLINKS else FileType.DIR)
    assert home["link-dir"].symlink_target == "/home/user/real"
    assert home["via-dir"].symlink_target == "/home/user/real/file.txt"
    assert "dangling" not in home and "cyclic" not in home  # no type: the SDK skips them, as it does with envd
    assert "/home/user/real/sub" in [e.path for e in home.values()]  # depth 2 went into the directory
    assert not [e for e in linked.files.list("/home/user", depth=3) if e.path.startswith("/home/user/link-dir/")]
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        linked.files.list("link-file")
    with pytest.raises(SandboxException, match="cyclic symlink"):
        linked.files.list("cyclic")


def _start_stream(sandbox: Sandbox) -> httpx.Response:
    headers = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token,
        "Content-Type": "application/connect+json",
    }
    body = frame({"process": {"cmd": "/bin/bash", "args": ["-c", "echo up; sleep 600"]}})
    url = f"{os.environ['E2B_SANDBOX_URL']}/process.Process/Start"
    return httpx.Client(timeout=30).send(httpx.Request("POST", url, headers=headers, content=body), stream=True)


def test_a_kill_while_a_command_streams_drops_the_connection(e2b_env: dict[str, str], server: EmbeddedServer) -> None:
    sandbox = Sandbox.create("base")
    try:
        response = _start_stream(sandbox)
        chunks = response.iter_raw()
        received = next(chunks)  # the start event: the command runs
        threading.Timer(0.5, sandbox.kill).start()
        with pytest.raises(httpx.ReadError, match="reset"):  # the connection is reset: no end, no last chunk
            for chunk in chunks:
                received += chunk
        assert b"end" not in received and b"unavailable" not in received
    finally:
        sandbox.kill()
    assert "without completing response" not in server.log_path.read_text()  # dropped on purpose: not logged
    again = Sandbox.create("base")
    try:
        handle = again.commands.run("sleep 600", background=True)
        threading.Timer(0.5, again.kill).start()
        started = time.monotonic()
        with pytest.raises(SandboxGoneError, match="killed"):
            handle.wait()
        assert time.monotonic() - started < 30
    finally:
        again.kill()
