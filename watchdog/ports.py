"""TCP ports: one free right now, and whether the server will be able to bind its own."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now, or None. Bound like uvicorn binds it (SO_REUSEADDR,
    so a port in TIME_WAIT is free); host "" is every address, vLLM's default."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except (OSError, OverflowError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None
