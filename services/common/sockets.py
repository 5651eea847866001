"""A listening socket bound before an HTTP server starts (the gateway's, the studio's), so its port is
known (port 0 = any free one) before uvicorn serves on it."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0 = any free one), bound before uvicorn starts so the port is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: a response's head and body go out at once (without it, the
    # second response on a keep-alive connection waited ~40 ms for the client's delayed ACK)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
