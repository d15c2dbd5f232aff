"""What `tokenspout serve` says on its way up and out, the same in every layout: a start-up problem in one
line, the line that says it serves, the exit code of an engine that will not come back. Light to import:
the supervisor uses it before anything of gRPC or the model is loaded."""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.config import ServeConfig

ENGINE_DOWN_EXIT_CODE = 3


class StartupError(Exception):
    """A start-up problem the operator fixes (a busy port, unreadable certificates): one line, exit 2."""


def check_port(listen: str) -> None:
    """A busy port fails here, in one line of ours, rather than in gRPC's own error log lines."""
    host, _, port = listen.rpartition(":")
    if port == "0" or "/" in listen or listen.startswith("unix:"):
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError) as exc:
        raise StartupError(f"cannot listen on {listen}: {exc}") from None
    problems = []
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(address)
            except OSError as exc:
                problems.append(exc)
    busy = [p for p in problems if p.errno == errno.EADDRINUSE]
    if busy or len(problems) == len(addresses):
        raise StartupError(f"cannot listen on {listen}: {(busy or problems)[0].strerror}")


def serving_line(config: ServeConfig, model_id: str, port: int) -> str:
    host = config.listen.rsplit(":", 1)[0]
    return f"tokenspout serving {model_id} on {host}:{port}"
