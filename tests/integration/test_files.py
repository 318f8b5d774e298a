"""File operations through the API, confined to the sandbox root."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

import corral


def test_write_read_stat_list(sandbox: corral.Sandbox) -> None:
    info = sandbox.files.write("/work/a.py", "print(1)\n", mode=0o755)
    assert (info.path, info.type, info.size, info.mode) == ("/work/a.py", "file", 9, 0o755)
    assert sandbox.files.read_text("/work/a.py") == "print(1)\n"
    assert sandbox.exec("cat /work/a.py").stdout == "print(1)\n"  # the command sees what the API wrote
    assert [f.name for f in sandbox.files.list("/work")] == ["a.py"]
    assert sandbox.files.stat("/work").type == "dir"
    assert sandbox.files.exists("/work/a.py") and not sandbox.files.exists("/work/b.py")


def test_binary_round_trip(sandbox: corral.Sandbox) -> None:
    data = bytes(range(256)) * 1000
    sandbox.files.write("/tmp/blob", data)
    assert sandbox.files.read("/tmp/blob") == data
    assert sandbox.exec("wc -c < /tmp/blob").stdout.strip() == str(len(data))


def test_reads_what_commands_wrote(sandbox: corral.Sandbox) -> None:
    sandbox.exec("echo from-shell > /root/out.txt; ln -s /root/out.txt /root/link")
    assert sandbox.files.read_text("/root/out.txt") == "from-shell\n"
    link = sandbox.files.stat("/root/link")
    assert link.type == "symlink" and link.link_target == "/root/out.txt"


def test_mkdir_and_remove(sandbox: corral.Sandbox) -> None:
    assert sandbox.files.mkdir("/a/b/c").type == "dir"
    sandbox.files.write("/a/b/c/f", "x")
    with pytest.raises(corral.Conflict):
        sandbox.files.remove("/a")
    sandbox.files.remove("/a", recursive=True)
    assert not sandbox.files.exists("/a")
    with pytest.raises(corral.NotFound):
        sandbox.files.remove("/a")


def test_missing_file_is_not_found(sandbox: corral.Sandbox) -> None:
    with pytest.raises(corral.NotFound, match="/nope"):
        sandbox.files.read("/nope")


def test_tar_upload_and_download(sandbox: corral.Sandbox) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in [("proj/main.py", "print('main')\n"), ("proj/lib/util.py", "X = 1\n")]:
            payload = text.encode()
            member = tarfile.TarInfo(name)
            member.size = len(payload)
            tar.addfile(member, io.BytesIO(payload))
    assert sandbox.files.upload_tar("/work", buffer.getvalue()) >= 2
    assert sandbox.exec("cat /work/proj/lib/util.py").stdout == "X = 1\n"

    with tarfile.open(fileobj=io.BytesIO(sandbox.files.download_tar("/work/proj")), mode="r:") as tar:
        names = sorted(tar.getnames())
        assert "proj/main.py" in names and "proj/lib/util.py" in names
        extracted = tar.extractfile("proj/main.py")
        assert extracted is not None and extracted.read() == b"print('main')\n"


def test_path_traversal_stays_inside(sandbox: corral.Sandbox, tmp_path: Path) -> None:
    host_secret = Path("/etc/hostname").read_text() if Path("/etc/hostname").exists() else None
    sandbox_hostname = sandbox.files.read_text("/../../../etc/hostname")
    assert sandbox_hostname == sandbox.exec("cat /etc/hostname").stdout
    assert sandbox_hostname != host_secret or host_secret is None


def test_symlink_escape_is_confined(sandbox: corral.Sandbox, tmp_path: Path) -> None:
    marker = tmp_path / "host-only-marker"
    marker.write_text("host secret")
    sandbox.exec(f"ln -s {marker} /escape; ln -s ../../../../{tmp_path} /escape-dir")
    with pytest.raises(corral.NotFound):
        sandbox.files.read("/escape")
    with pytest.raises(corral.NotFound):
        sandbox.files.read(f"/escape-dir/{marker.name}")
    try:  # resolves inside the sandbox, where that directory does not exist
        sandbox.files.write(f"/escape-dir/{marker.name}-2", "x")
    except corral.InvalidRequest:
        pass
    assert not (tmp_path / f"{marker.name}-2").exists()
    assert marker.read_text() == "host secret"


def test_proc_is_refused(sandbox: corral.Sandbox) -> None:
    with pytest.raises(corral.InvalidRequest):
        sandbox.files.read("/proc/1/environ")


def test_oversized_upload_is_refused(server, sandbox: corral.Sandbox) -> None:  # type: ignore[no-untyped-def]
    """The server refuses on the declared length, before reading a byte of the body."""
    import socket

    too_big = 256 * 1024 * 1024 + 1
    request = (
        f"PUT /v1/sandboxes/{sandbox.id}/files/content?path=/big HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Length: {too_big}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(request.encode())
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
        response = b"".join(chunks).decode()
    assert response.startswith("HTTP/1.1 413"), response
    assert "payload_too_large" in response
    assert not sandbox.files.exists("/big")


def test_files_belong_to_the_sandbox_user(client: corral.Client) -> None:
    with client.create("busybox", user="user") as sandbox:
        info = sandbox.files.write("/home/user/new/notes.txt", "a\n")
        assert (info.uid, info.gid) == (1000, 1000)
        assert sandbox.exec("echo b >> /home/user/new/notes.txt && cat /home/user/new/notes.txt").stdout == "a\nb\n"
    with client.create("busybox") as sandbox:
        assert (sandbox.files.write("/root/x", "1").uid) == 0
