"""llama.cpp's own C++ `llama-server`, the reference the benchmarks compare against.

Built from the source vendored in the llama-cpp-python sdist this project pins (see docs/benchmarks.md);
same GGUF, same slots and threads as the tokenspout server it is compared with.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass


@dataclass
class LlamaServer:
    process: subprocess.Popen
    port: int

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()

    def stream(self, prompt: str | list[int], tokens: int, cache_prompt: bool = True, ignore_eos: bool = True) -> Completion:
        """One greedy completion through the streaming (SSE) endpoint, timed as a client sees it."""
        body = json.dumps(
            {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": ignore_eos,
             "cache_prompt": cache_prompt, "stream": True}
        ).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                         {"Content-Type": "application/json"})
        start = time.perf_counter()
        first = None
        received = 0
        last: dict = {}
        pieces: list[str] = []
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                pieces.append(chunk.get("content", ""))
                if chunk.get("stop"):
                    last = chunk
                    received = chunk.get("tokens_predicted", received)
                    break
                first = first or time.perf_counter()
                received += 1
        timings = last.get("timings", {})
        return Completion(
            ttft_s=(first or time.perf_counter()) - start,
            total_s=time.perf_counter() - start,
            tokens=received,
            prompt_computed=timings.get("prompt_n", 0),
            prompt_cached=timings.get("cache_n", 0),
            text="".join(pieces),
        )


@dataclass
class Completion:
    ttft_s: float
    total_s: float
    tokens: int
    prompt_computed: int
    prompt_cached: int
    text: str
    """Everything it streamed."""


def start_llama_server(
    binary: str, model: pathlib.Path, context: int, slots: int, threads: int, extra: list[str] = ()
) -> LlamaServer:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [binary, "-m", str(model), "-c", str(context * slots), "-np", str(slots), "-t", str(threads),
         "--port", str(port), "--host", "127.0.0.1", "--no-webui", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return LlamaServer(process, port)
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("llama-server did not start")
