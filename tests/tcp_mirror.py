"""A TCP service that answers every connection with one line: the "package mirror" network tests reach.

Run it in a network namespace of the test's own (``unshare --net python -c SERVER``), then plug that
namespace into the server's sandbox network as a peer.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from corral.embedded import EmbeddedServer

SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen()
while True:
    conn, _ = s.accept()
    conn.sendall(b"ok from mirror\\n")
    conn.close()
"""


@contextlib.contextmanager
def plugged_mirror(server: EmbeddedServer, name: str, address: str) -> Iterator[str]:
    """The mirror running in a network namespace of its own, plugged into ``server``'s sandbox network as peer
    ``name`` at ``address``; stopped (by its PID) on the way out."""
    process = subprocess.Popen(["unshare", "--net", sys.executable, "-c", SERVER])
    try:
        time.sleep(0.3)
        with server.client() as client:
            client.attach_network_peer(name, f"/proc/{process.pid}/ns/net", address)
        yield address
    finally:
        process.kill()
        process.wait()
