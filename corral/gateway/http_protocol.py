"""uvicorn's HTTP/1.1 protocol with one addition: a response may reset its TCP connection.

ASGI has no way to abort a response. A response left unfinished makes uvicorn
close the connection (FIN), which a client reads as a truncated body, a
protocol error. E2B's SDKs tell "the sandbox went away" from "the server sent
garbage" by exactly that: a reset connection is a transport failure, after
which they ask the sandbox's ``/health`` and report it killed (e2b 2.45 with
its HTTP client, pyqwest 0.10, reads a truncated chunked body as
``RemoteProtocolError`` and blames a timeout instead). So each request's
scope carries the extension ``corral.reset_connection``: calling it sets
``SO_LINGER`` to zero, and the close that follows the unfinished response
sends a RST. Servers without it (an app run some other way) fall back to the
plain close.
"""

from __future__ import annotations

import socket
import struct

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["RESET_CONNECTION", "ResettableHttpToolsProtocol"]

RESET_CONNECTION = "corral.reset_connection"
_LINGER_OFF_AT_ONCE = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends RST


class ResettableHttpToolsProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions: dict[str, object] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
        extensions[RESET_CONNECTION] = self._reset_on_close

    def _reset_on_close(self) -> None:
        sock: socket.socket | None = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF_AT_ONCE)
