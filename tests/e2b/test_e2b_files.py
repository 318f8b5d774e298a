"""File URLs and options of newer envd versions, through the real e2b SDK (sync): signed download/upload URLs.

A signed URL is used as a browser or curl would: plain HTTP, no header at all.
"""

from __future__ import annotations

import time
import urllib.parse

import httpx
import pytest
from e2b import FilesystemEventType, Sandbox


@pytest.fixture
def sbx(e2b_sandboxes: list) -> Sandbox:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", timeout=300, allow_internet_access=False)
    e2b_sandboxes.append(sandbox)
    return sandbox


def _with_query(url: str, **changes: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query)) | changes
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def test_signed_urls_work_without_headers_until_they_expire(sbx: Sandbox) -> None:
    sbx.files.write("signed/report.txt", "for the browser")
    url = sbx.download_url("signed/report.txt", use_signature_expiration=60)
    assert "signature=v1_" in url and "signature_expiration=" in url
    got = httpx.get(url)
    assert got.status_code == 200 and got.text == "for the browser"
    assert httpx.get(sbx.download_url("signed/report.txt")).text == "for the browser"  # signed, no expiry
    expired = httpx.get(sbx.download_url("signed/report.txt", use_signature_expiration=-5))
    assert expired.status_code == 401 and "expired" in expired.json()["message"]
    later = int(dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["signature_expiration"]) + 3600
    for tampered in (_with_query(url, path="/etc/shadow"), _with_query(url, signature_expiration=str(later)),
                     _with_query(url, username="root"), url.replace("signature=v1_", "signature=v1_x")):  # fmt: skip
        refused = httpx.get(tampered)
        assert refused.status_code == 401 and "matches no sandbox" in refused.json()["message"], tampered
    assert httpx.post(url, files={"file": ("x", b"no")}).status_code == 401  # a read signature cannot write

    upload = sbx.upload_url("signed/up.txt", use_signature_expiration=60)
    done = httpx.post(upload, files={"file": ("up.txt", b"uploaded by url")})
    assert done.status_code == 200 and done.json()[0]["path"] == "/home/user/signed/up.txt"
    assert sbx.files.read("signed/up.txt") == "uploaded by url"
    late = httpx.post(sbx.upload_url("signed/late.txt", use_signature_expiration=-5), files={"file": ("l", b"x")})
    assert late.status_code == 401 and not sbx.files.exists("signed/late.txt")


def test_file_metadata_is_kept_as_xattrs_and_listed(sbx: Sandbox) -> None:
    assert str(sbx._envd_version) == "0.6.4"  # what the SDK gates metadata and watch options on
    sbx.files.write("meta/a.txt", "a", metadata={"Owner": "agent-7", "step": "3"})
    sbx.files.write("meta/b.txt", "b")
    assert sbx.files.get_info("meta/a.txt").metadata == {"owner": "agent-7", "step": "3"}  # keys lowercased
    listed = {entry.name: entry.metadata for entry in sbx.files.list("meta")}
    assert listed == {"a.txt": {"owner": "agent-7", "step": "3"}, "b.txt": None}
    inside = sbx.commands.run("python3 -c \"import os; print(os.getxattr('meta/a.txt', 'user.owner').decode())\"")
    assert inside.stdout == "agent-7\n"  # a real extended attribute on the file, seen from inside
    sbx.commands.run("python3 -c \"import os; os.setxattr('meta/b.txt', 'user.tag', b'set inside')\"")
    assert sbx.files.get_info("meta/b.txt").metadata == {"tag": "set inside"}


def test_watch_events_carry_the_entry(sbx: Sandbox) -> None:
    sbx.files.make_dir("watched")
    handle = sbx.files.watch_dir("watched", include_entry=True, allow_network_mounts=True)
    plain = sbx.files.watch_dir("watched")
    sbx.files.write("watched/new.txt", "12345")
    time.sleep(1)
    events = handle.get_new_events()
    created = [e for e in events if e.type == FilesystemEventType.CREATE and e.name == "new.txt"]
    assert created and created[0].entry is not None
    assert created[0].entry.path == "/home/user/watched/new.txt" and created[0].entry.size == 5
    assert all(e.entry is None for e in plain.get_new_events())  # only when asked for
    sbx.files.remove("watched/new.txt")
    time.sleep(1)
    removed = [e for e in handle.get_new_events() if e.type == FilesystemEventType.REMOVE]
    assert removed and removed[0].entry is None  # nothing left to describe
    handle.stop()
    plain.stop()
