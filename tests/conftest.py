"""Shared fixtures, in two lanes.

Tests marked `model` need the real embedded model: they ask for `model` (loaded in this process),
`model_path`, or `server` / `channel` / `stub` (a real server serving it), and the mark follows from
that (pytest_collection_modifyitems). Every other test needs no model: the service's tests run on
tests/fake_engine.py, in process (`fake_server`, `fake_channel`, `fake_stub`, inprocess_server.start_fake)
or as a real `tokenspout serve` process where signals and exit codes matter
(start_server(..., fake_engine=True)). `make test-fast` runs that lane alone (`-m "not model"`),
and there anything that would load the model fails, naming the fixture to ask for.
"""

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

from inprocess_server import InProcessServer, start_fake
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
    fake_engine: bool = False,
    root: pathlib.Path = ROOT,
) -> RunningServer:
    """Starts `tokenspout serve` on a free port and waits until it says it is serving; with `faults`
    (flags of tests/faults.py), on an engine those faults are injected into; with `fake_engine`, on
    tests/fake_engine.py's engine instead of the model; with `root`, from another checkout (the
    benchmarks compare versions)."""
    if not fake_engine:
        _refuse_in_the_fast_lane("starts a server on the real model")
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    log_file = open(log_path, "w")
    if faults or fake_engine:
        command = [str(ROOT / "tests" / "faults.py"), *faults, *(["--fake-engine"] if fake_engine else [])]
    else:
        command = ["-m", "service.cli"]
    process = subprocess.Popen(
        [sys.executable, *command, "serve", "--listen", "127.0.0.1:0", *flags],
        cwd=root,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, **({"PYTHONPATH": f"{root}:{root / 'clients' / 'python'}"} if root != ROOT else {}), **(env or {})},
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


MODEL_FIXTURES = frozenset({"model", "model_path", "server"})
"""Asking for one of these (directly or through another fixture) marks a test `model`."""
FAST_LANE = False
"""Set when the run deselects the model lane (`-m "not model"`): nothing may load the model then."""


def pytest_configure(config) -> None:
    global FAST_LANE
    FAST_LANE = "not model" in (config.getoption("markexpr") or "")
    if FAST_LANE:
        import backend.models

        backend.models.default_model_path = lambda: _refuse_in_the_fast_lane("loads the embedded model")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


def _refuse_in_the_fast_lane(what: str):
    if FAST_LANE:
        pytest.fail(f"this test {what} but is not marked `model`: ask for the `model_path` fixture")


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    """The embedded model's file (fetched once): tests that start servers on it ask for this."""
    from backend.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def model(model_path: pathlib.Path):
    """The embedded model loaded in this process (read-only: tests share it)."""
    from backend.llamacpp.model import GgufModel

    loaded = GgufModel(model_path)
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path) -> Iterator[RunningServer]:
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


@pytest.fixture(scope="module")
def fake_server() -> Iterator[InProcessServer]:
    """An in-process server on the fake engine, with the settings of `server`."""
    running = start_fake("--context-length", str(SERVER_CONTEXT_LENGTH), "--max-batch-size", "8")
    yield running
    running.close()


@pytest.fixture(scope="module")
def fake_channel(fake_server: InProcessServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fake_server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def fake_stub(fake_channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(fake_channel)


SHARED_DATA = ROOT.parent / "shared" / "data"
REPORT: list[str] = []
"""Figures tests measure (counts, rates), printed in the summary of every run."""


def pytest_terminal_summary(terminalreporter) -> None:
    if REPORT:
        terminalreporter.section("tokenspout measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
