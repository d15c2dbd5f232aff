"""What the service adds to one call's first message: tokenspout on the fake engine against
bench.minimal_server (the same step loop behind a bare grpc.aio server), one call at a time from the
same synchronous Python client (bench.first_token's call: 8 tokens, timed to the first), each call
going to each server in turn (which goes first alternates), in one run.

Both engines are paced at a short `--step-s`, so a call waits for the next step alike on both; the
difference between the medians is the service's own share of a first token's latency (checks,
admission, prompt, submission, the relay, the stream), which `bench.first_token` cannot separate
from llama.cpp's decode and from gRPC against HTTP.

    python -m bench.first_message [--calls 300] [--step-s 0.001]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import grpc

from bench.first_token import first_token_s
from bench.service_ceiling import start_minimal
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SIDES = ("tokenspout", "minimal")


def measure(stubs: dict[str, pb_grpc.GenerationServiceStub], calls: int) -> dict[str, list[float]]:
    """Each side's first-message latencies, `calls` of them, the sides taking turns."""
    for stub in stubs.values():  # warm: channels, the first calls' paths
        for index in range(20):
            first_token_s(stub, f"Hello there {index}")
    latencies: dict[str, list[float]] = {side: [] for side in stubs}
    for index in range(calls):
        order = list(stubs) if index % 2 == 0 else list(stubs)[::-1]
        for side in order:
            latencies[side].append(first_token_s(stubs[side], f"Hello there {index}"))
    return latencies


def summary(latencies: dict[str, list[float]]) -> str:
    lines = []
    for side, values in latencies.items():
        ordered = sorted(values)
        lines.append(f"{side}: median {statistics.median(ordered) * 1e3:.3f} ms, "
                     f"p10 {ordered[len(ordered) // 10] * 1e3:.3f}, p90 {ordered[9 * len(ordered) // 10] * 1e3:.3f}")
    ours, theirs = (statistics.median(latencies[side]) for side in SIDES)
    lines.append(f"added by the service: {(ours - theirs) * 1e3:.3f} ms a first message (ratio {ours / theirs:.2f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.first_message")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--step-s", type=float, default=0.001)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenspout = start_server(pathlib.Path(tmp), faults=("--step-s", str(args.step_s)), fake_engine=True)
        minimal, minimal_address = start_minimal(args.step_s)
        channels = {"tokenspout": grpc.insecure_channel(tokenspout.address), "minimal": grpc.insecure_channel(minimal_address)}
        try:
            print(summary(measure({side: pb_grpc.GenerationServiceStub(c) for side, c in channels.items()}, args.calls)))
        finally:
            for channel in channels.values():
                channel.close()
            stop_server(tokenspout)
            minimal.terminate()
            minimal.wait(timeout=30)


if __name__ == "__main__":
    main()
