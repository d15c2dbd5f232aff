"""Tracing overhead on the embedded model, from one run.

Prints decode tokens/s with tracing on (every span exported over OTLP/gRPC to a
local receiver) divided by tracing off, at 1 and 8 streams (target >= 0.97).

    python -m bench.telemetry [--tokens 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

import grpc

from bench.common import PROMPTS, aggregate_rate, timed_stream
from tests.harness.otlp_collector import start_collector
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    collector, receiver, port = start_collector()
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    flags = ("--context-length", "1024", "--max-batch-size", "8")
    clean_env = {name: "" for name in os.environ if name.startswith("OTEL_")}
    plain = start_server(tmp, *flags, env=clean_env)
    traced = start_server(tmp, *flags, env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
    })
    try:
        with grpc.insecure_channel(plain.address) as a, grpc.insecure_channel(traced.address) as b:
            stubs = {"off": pb_grpc.GenerationServiceStub(a), "on": pb_grpc.GenerationServiceStub(b)}
            for stub in stubs.values():
                timed_stream(stub, PROMPTS[0], 8)
            for streams in (1, 8):
                rates: dict[str, list[float]] = {"off": [], "on": []}
                for _ in range(args.reps):  # alternate so that noise hits both alike
                    for mode, stub in stubs.items():
                        rates[mode].append(aggregate_rate(stub, streams, args.tokens))
                off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
                print(f"{streams} stream(s): tracing off {off:.1f} tok/s, on {on:.1f} tok/s, "
                      f"ratio {on / off:.3f} (target >= 0.97)")
    finally:
        stop_server(plain)
        stop_server(traced)  # flushes its last batch of spans
        receiver.stop(None)
    print(f"spans received by the local collector: {len(collector.spans)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
