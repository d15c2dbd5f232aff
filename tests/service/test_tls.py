"""TLS and mutual TLS on a real `tokenspout serve` process (on the fake engine)."""

from __future__ import annotations

import os
import shutil
import subprocess

import grpc
import pytest

from tests.harness.helpers import greedy, stream
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

# CI always has openssl: missing there, the TLS tests must fail rather than skip.
pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None and not os.environ.get("CI"), reason="needs the openssl command"
)


def make_cert(directory, name: str, ca: tuple | None = None) -> tuple:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subject = ["-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
    if ca is None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", key, "-out", cert,
             *subject],
            check=True, capture_output=True,
        )
    else:
        csr = directory / f"{name}.csr"
        subprocess.run(
            ["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, *subject],
            check=True, capture_output=True,
        )
        subprocess.run(
            ["openssl", "x509", "-req", "-in", csr, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial", "-days", "1",
             "-copy_extensions", "copy", "-out", cert],
            check=True, capture_output=True,
        )
    return key, cert


def test_tls_and_mutual_tls(tmp_path):
    ca = make_cert(tmp_path, "test-ca")
    server_key, server_cert = make_cert(tmp_path, "server", ca)
    client_key, client_cert = make_cert(tmp_path, "client", ca)
    server = start_server(
        tmp_path, "--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-client-ca", str(ca[1]),
        "--max-batch-size", "2", "--context-length", "256", fake_engine=True,
    )
    try:
        good = grpc.ssl_channel_credentials(ca[1].read_bytes(), client_key.read_bytes(), client_cert.read_bytes())
        with grpc.secure_channel(server.address, good) as channel:
            messages = stream(pb_grpc.GenerationServiceStub(channel), greedy("Hello", max_new_tokens=3), timeout=30)
            assert messages[-1].HasField("finish")
        no_client_cert = grpc.ssl_channel_credentials(ca[1].read_bytes())
        with grpc.secure_channel(server.address, no_client_cert) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                stream(pb_grpc.GenerationServiceStub(channel), greedy("Hello", max_new_tokens=3), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError):
                stream(pb_grpc.GenerationServiceStub(channel), greedy("Hello", max_new_tokens=3), timeout=10)
    finally:
        assert stop_server(server) == 0
