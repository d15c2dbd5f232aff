"""Tracing overhead on the embedded model, from one run.

Prints decode tokens/s with tracing on (every span exported over OTLP/gRPC to a
local receiver) divided by tracing off, at 1 and 8 streams (target >= 0.97).

    python bench/telemetry.py [--tokens 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402

from conftest import start_server, stop_server  # noqa: E402
from otlp_collector import start_collector  # noqa: E402
from tokenspout.v1 import generation_pb2 as pb  # noqa: E402
from tokenspout.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PROMPTS = ["Water boils at", "The moon is", "Cats are", "Rain falls", "Trees grow", "Rivers run", "Bread is", "Snow is"]


def decode_rate(stub, prompt: str, tokens: int) -> float:
    request = pb.GenerateStreamRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    )
    first = last = None
    for _message in stub.GenerateStream(request, timeout=300):
        last = time.perf_counter()
        first = first or last
    return (tokens - 1) / (last - first)


def aggregate(stub, streams: int, tokens: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda p: decode_rate(stub, p, tokens), PROMPTS[:streams]))
    return streams * tokens / (time.perf_counter() - start)


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
                decode_rate(stub, PROMPTS[0], 8)
            for streams in (1, 8):
                rates: dict[str, list[float]] = {"off": [], "on": []}
                for _ in range(args.reps):  # alternate so that noise hits both alike
                    for mode, stub in stubs.items():
                        rates[mode].append(aggregate(stub, streams, args.tokens))
                off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
                print(f"{streams} stream(s): tracing off {off:.1f} tok/s, on {on:.1f} tok/s, ratio {on / off:.3f} (target >= 0.97)")
        print(f"spans received by the local collector: {len(collector.spans)}")
    finally:
        stop_server(plain)
        stop_server(traced)
        receiver.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
