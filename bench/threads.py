"""Which `threads` default survives a shared machine: every core, every core but one, or the engine's
choice between them (0: it probes the other count now and then and keeps the faster).

Starts the server with each setting in turn (alternating, rep by rep), decodes 256 tokens first (so the
adaptive setting has had its first probe), then measures decode tokens/s at 1 and 8 streams through gRPC
and the time to first token, first on a quiet machine, then beside one busy process (another program
wanting one core, as on any shared host).

    python -m bench.threads [--reps 2] [--tokens 96]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

import grpc

from bench.common import aggregate_rate, greedy_request, timed_stream
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def first_token_s(stub, prompt: str) -> float:
    start = time.perf_counter()
    first = None
    for _ in stub.GenerateStream(greedy_request(prompt, 4), timeout=300):
        first = first or time.perf_counter() - start
    return first


def measure(threads: int, tokens: int) -> tuple[float, float, float]:
    """(1-stream tok/s, 8-stream tok/s, median TTFT s) for a server with `threads`."""
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    server = start_server(tmp, "--context-length", "1024", "--max-batch-size", "8", "--threads", str(threads))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            timed_stream(stub, "Warm up", 256)
            single = statistics.median(timed_stream(stub, "The history of the printing press", tokens)[1] for _ in range(2))
            eight = aggregate_rate(stub, 8, tokens)
            ttft = statistics.median(first_token_s(stub, f"Question {i}: why is the sky blue?") for i in range(8))
            return single, eight, ttft
    finally:
        stop_server(server)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    counts = [*sorted({max(1, cores - 1), cores}), 0]
    print(f"{cores} cores; threads settings {counts} (0: adaptive)")
    for busy in (False, True):
        stop = multiprocessing.Event()
        hog = multiprocessing.Process(target=spin, args=(stop,)) if busy else None
        if hog:
            hog.start()
        try:
            results: dict[int, list[tuple[float, float, float]]] = {n: [] for n in counts}
            for _ in range(args.reps):
                for n in counts:
                    results[n].append(measure(n, args.tokens))
        finally:
            if hog:
                stop.set()
                hog.join()
        print("beside one busy process:" if busy else "quiet machine:")
        for n, runs in results.items():
            single, eight, ttft = (statistics.median(r[i] for r in runs) for i in range(3))
            print(f"  threads {n}: 1 stream {single:.1f} tok/s, 8 streams {eight:.1f} tok/s, TTFT {ttft * 1000:.1f} ms")
        time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
