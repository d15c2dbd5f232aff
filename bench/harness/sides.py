"""The sides a benchmark compares, started and stopped as context managers: tokenspout servers (this
checkout or another's), llama.cpp's llama-server (the reference), the minimal grpc.aio server, and the
engine driven in-process. `with Sides() as sides:` stops every side it started, in reverse order."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile

import grpc

from bench.harness.llama_server import LlamaServer, start_llama_server
from tests.harness.servers import ROOT, RunningServer, start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

CONTEXT, SLOTS, THREADS = 1024, 8, min(2, len(os.sched_getaffinity(0)))
"""What the benchmarks give both servers unless they say otherwise: llama-server's `-np 8`, 2 threads (one where
the process has one core: a test worker's share, tests/conftest.py)."""
SERVER_FLAGS = ("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(THREADS))


class Served:
    """A running tokenspout server with a channel and a stub to it."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.address = server.address
        self.pid = server.process.pid
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)


class Sides(contextlib.ExitStack):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = pathlib.Path(self.enter_context(tempfile.TemporaryDirectory(prefix="tokenspout-bench-")))

    def tokenspout(self, *flags: str, root: pathlib.Path = ROOT, fake_engine: bool = False,
                   faults: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Served:
        """`tokenspout serve` with `flags` (SERVER_FLAGS unless given), from `root`'s checkout."""
        server = start_server(self.tmp, *(flags or SERVER_FLAGS), root=root, fake_engine=fake_engine, faults=faults, env=env)
        self.callback(stop_server, server)
        served = Served(server)
        self.callback(served.channel.close)
        return served

    def llama_server(self, binary: str, *extra: str, model: pathlib.Path | None = None, context: int = CONTEXT,
                     slots: int = SLOTS, threads: int = THREADS) -> LlamaServer:
        """The reference at its defaults (`cache_prompt` on for every request), plus `extra` flags."""
        from backend import default_model_path

        reference = start_llama_server(binary, model or default_model_path(), context, slots, threads, list(extra))
        self.callback(reference.stop)
        return reference

    def minimal_server(self, step_s: float) -> tuple[int, str]:
        """bench.harness.minimal_server paced at `step_s`: (its pid, its address)."""
        process = subprocess.Popen([sys.executable, "-m", "bench.harness.minimal_server", "--step-s", str(step_s)],
                                   cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.callback(_stop, process)
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("minimal server on "):
            raise RuntimeError(f"the minimal server did not start: {line!r}")
        return process.pid, line.split()[-1]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=30)
