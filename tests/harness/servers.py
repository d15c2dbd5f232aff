"""Starting and stopping real `tokenspout serve` processes, and the figures a run reports: what the
tests (through conftest's fixtures) and the benchmarks share."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_DATA = ROOT.parent / "shared" / "data"
SERVER_CONTEXT_LENGTH = 1024
REPORT: list[str] = []
"""Figures tests measure (counts, rates), printed in the summary of every run."""
FAST_LANE = False
"""Set by conftest when the run deselects the model lane (`-m "not model"`): nothing may load the model then."""


def refuse_in_the_fast_lane(what: str) -> None:
    if FAST_LANE:
        import pytest

        pytest.fail(f"this test {what} but is not marked `model`: ask for the `model_path` fixture")


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
    (flags of tests/harness/faults.py), on an engine those faults are injected into; with `fake_engine`, on
    tests/harness/fake_engine.py's engine instead of the model; with `root`, from another checkout (the
    benchmarks compare versions)."""
    if not fake_engine:
        refuse_in_the_fast_lane("starts a server on the real model")
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    log_file = open(log_path, "w")
    if faults or fake_engine:
        command = ["-m", "tests.harness.faults", *faults, *(["--fake-engine"] if fake_engine else [])]
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
        time.sleep(0.02)  # a start takes ~1.7 s: polled finely, it is timed finely (bench versions)
    process.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def stop_server(server: RunningServer) -> int:
    if server.process.poll() is None:
        server.process.terminate()
    return server.process.wait(timeout=60)
