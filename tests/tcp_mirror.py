"""A TCP service that answers every connection with one line: the "package mirror" network tests reach.

Run it in a network namespace of the test's own (``unshare --net python -c SERVER``), then plug that
namespace into the server's sandbox network as a peer.
"""

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
