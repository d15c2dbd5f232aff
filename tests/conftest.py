"""Shared fixtures: a real tokenspout server on a loopback port, serving the real model."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Iterator

import grpc
import pytest

from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVER_CONTEXT_LENGTH = 1024


class RunningServer:
    def __init__(self, process: subprocess.Popen, address: str, log_path: pathlib.Path) -> None:
        self.process = process
        self.address = address
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = 30) -> None:
        """Waits until the server has logged `text` (signals and reloads are handled asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert time.monotonic() < deadline, f"the server never logged {text!r}:\n{self.log()}"
            time.sleep(0.05)

    def wait_until_draining(self) -> None:
        """Waits until a signalled server drains: it refuses new calls from that log line on
        (the refusal is set in the same synchronous run that logs it)."""
        self.wait_for_log("draining: up to")


def start_server(
    tmp_dir: pathlib.Path,
    *flags: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
    faults: tuple[str, ...] = (),
) -> RunningServer:
    """Starts `tokenspout serve` on a free port and waits until it says it is serving; with `faults`
    (flags of tests/faults.py), on an engine those faults are injected into."""
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    log_file = open(log_path, "w")
    command = [str(ROOT / "tests" / "faults.py"), *faults] if faults else ["-m", "service.cli"]
    process = subprocess.Popen(
        [sys.executable, *command, "serve", "--listen", "127.0.0.1:0", *flags],
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(r"tokenspout serving .* on (\S+:\d+)", log_path.read_text())
        if match:
            return RunningServer(process, match.group(1), log_path)
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def stop_server(server: RunningServer) -> int:
    if server.process.poll() is None:
        server.process.terminate()
    return server.process.wait(timeout=60)


@pytest.fixture(scope="session")
def model():
    """The embedded model loaded in this process (read-only: tests share it)."""
    from backend.llamacpp.model import GgufModel
    from backend.models import default_model_path

    loaded = GgufModel(default_model_path())
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("server"), "--context-length", str(SERVER_CONTEXT_LENGTH), "--max-batch-size", "8"
    )
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture(scope="session")
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(channel)


SHARED_DATA = ROOT.parent / "shared" / "data"
REPORT: list[str] = []
"""Figures tests measure (counts, rates), printed in the summary of every run."""


def pytest_terminal_summary(terminalreporter) -> None:
    if REPORT:
        terminalreporter.section("tokenspout measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
