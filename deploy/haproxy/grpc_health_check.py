"""Prints the `tcp-check` lines of haproxy.cfg: a gRPC health check HAProxy can send.

HAProxy's `http-check send` cannot carry a gRPC message: its body is a string, and the
5-byte gRPC frame of an empty HealthCheckRequest is all NUL bytes. So the check is raw
HTTP/2 (prior knowledge, as h2c backends speak): the client preface, an empty SETTINGS
frame, a HEADERS frame for POST /grpc.health.v1.Health/Check (HPACK literals, no Huffman,
no dynamic table) and a DATA frame holding that empty request. The check passes only when
the answer's DATA frame holds HealthCheckResponse{status: SERVING}: a replica that drains
or whose engine died answers NOT_SERVING and leaves the rotation at that check, without
waiting for the check's timeout.

    python deploy/haproxy/grpc_health_check.py [SERVICE]   # "" checks the whole server
"""

from __future__ import annotations

import sys

SERVING_MESSAGE = bytes([0, 0, 0, 0, 2, 0x08, 0x01])
"""A gRPC frame (uncompressed, 2 bytes) holding field 1 (status) = 1 (SERVING)."""


def _literal(name: int | str, value: str) -> bytes:
    """An HPACK literal header field without indexing: a static-table name index or a new name."""
    if isinstance(name, int):
        prefix = bytes([name]) if name < 15 else bytes([0x0F, name - 15])
    else:
        prefix = b"\x00" + _string(name)
    return prefix + _string(value)


def _string(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 127, "one-byte HPACK lengths only"
    return bytes([len(data)]) + data


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def grpc_request(path: str, message: bytes, authority: str, *headers: tuple[str, str]) -> bytes:
    """A whole unary-request gRPC call as a client opens it: preface, SETTINGS, HEADERS, DATA."""
    block = (
        b"\x83"  # :method POST (static index 3)
        + b"\x86"  # :scheme http (static index 6)
        + _literal(4, path)  # :path
        + _literal(1, authority)  # :authority
        + _literal(31, "application/grpc")  # content-type
        + _literal("te", "trailers")
        + b"".join(_literal(name, value) for name, value in headers)
    )
    return (
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + _frame(0x4, 0x0, 0, b"")  # SETTINGS, all defaults
        + _frame(0x1, 0x4, 1, block)  # HEADERS, END_HEADERS, stream 1
        + _frame(0x0, 0x1, 1, b"\x00" + len(message).to_bytes(4, "big") + message)  # DATA, END_STREAM
    )


def health_request(service: str = "") -> bytes:
    message = b"\x0a" + _string(service) if service else b""  # HealthCheckRequest{service}
    return grpc_request("/grpc.health.v1.Health/Check", message, "haproxy-health-check")


def tcp_check_lines(service: str = "") -> list[str]:
    return [
        "option tcp-check",
        "tcp-check connect",
        f"tcp-check send-binary {health_request(service).hex()}",
        # Wait for the answer (any status), then judge it at once: with min-recv set, a
        # mismatch is final instead of a wait for more data until the check times out.
        f"tcp-check expect binary {SERVING_MESSAGE[:-1].hex()}",
        f"tcp-check expect min-recv 1 binary {SERVING_MESSAGE.hex()}",
    ]


if __name__ == "__main__":
    print("\n".join(tcp_check_lines(sys.argv[1] if len(sys.argv) > 1 else "")))
