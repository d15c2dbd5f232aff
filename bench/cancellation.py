"""Cancellation and slow-reader benchmark on the embedded model, every figure from one run.

Prints:
  1. cancellation latency, caller cancel -> cache freed: in engine steps and milliseconds
     (server side, from GetServerStatus) and as the caller sees it (cancel -> status shows it freed)
  2. aggregate tokens/s of 8 streams alone, and of the same 8 beside a caller that reads one
     message per second (ratio, target >= 0.95); the slow reader is paused while its buffer is
     full and resumed when it reads, so it still gets what it reads

    python -m bench.cancellation [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import threading
import time

import grpc

from bench.common import PROMPTS, aggregate_rate, greedy_request
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

def cancel_latency(stub) -> tuple[int, float, float]:
    """(engine steps, server ms, caller-observed ms) for one cancellation mid-stream."""
    call = stub.GenerateStream(greedy_request(PROMPTS[0], 500), timeout=60)
    for _, _message in zip(range(5), call):
        pass
    start = time.perf_counter()
    call.cancel()
    while True:
        status = stub.GetServerStatus(pb.GetServerStatusRequest())
        if status.running_sequences == 0 and status.cache_tokens_used == 0:
            observed = (time.perf_counter() - start) * 1000
            return status.last_cancel_latency_steps, status.last_cancel_latency_ms, observed


def aggregate(stub, tokens: int) -> tuple[float, float]:
    """Tokens/s of the 8 streams, and the seconds they took."""
    start = time.perf_counter()
    rate = aggregate_rate(stub, len(PROMPTS), tokens)
    return rate, time.perf_counter() - start


def aggregate_beside_slow_reader(stub, address: str, tokens: int) -> tuple[float, float]:
    """Tokens/s of the 8 streams while a 9th caller reads one message per second, and the
    tokens/s of all nine (the slow reader still gets what it reads)."""
    channel = grpc.insecure_channel(address, options=[("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)])
    slow = pb_grpc.GenerationServiceStub(channel).GenerateStream(greedy_request("Mountains are", 1000), timeout=300)
    received = [next(slow).generated_tokens]
    stop = threading.Event()

    def read_slowly():
        for message in slow:
            received.append(message.generated_tokens)
            if stop.wait(1.0):
                break

    reader = threading.Thread(target=read_slowly)
    reader.start()
    try:
        start_tokens = received[-1]
        rate, elapsed = aggregate(stub, tokens)
        slow_tokens = received[-1] - start_tokens
        return rate, rate + slow_tokens / elapsed
    finally:
        stop.set()
        slow.cancel()
        reader.join()
        channel.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    server = start_server(
        pathlib.Path(os.environ.get("TMPDIR", "/tmp")), "--max-batch-size", "9", "--context-length", "1024",
        "--stream-buffer-events", "16",
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            samples = [cancel_latency(stub) for _ in range(args.reps)]
            steps = [s for s, _, _ in samples]
            print(
                f"cancel -> cache freed over {args.reps} cancellations: engine steps max {max(steps)}, "
                f"server {statistics.median(s[1] for s in samples):.2f} ms median, "
                f"caller-observed {statistics.median(s[2] for s in samples):.2f} ms median"
            )
            alone, beside, everyone = [], [], []
            for _ in range(3):  # alternate so that noise hits both alike
                alone.append(aggregate(stub, args.tokens)[0])
                fast, total = aggregate_beside_slow_reader(stub, server.address, args.tokens)
                beside.append(fast)
                everyone.append(total)
            a, b, t = statistics.median(alone), statistics.median(beside), statistics.median(everyone)
            print(f"8 streams: alone {a:.1f} tok/s, beside a slow reader {b:.1f} tok/s, ratio {b / a:.3f} (target >= 0.95)")
            print(f"  all nine streams together, the slow reader's tokens included: {t:.1f} tok/s, ratio {t / a:.3f}")
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
