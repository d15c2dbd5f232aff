"""Fuzzing one real server at volume: status codes per call, and memory before and after.

Sends random GenerateStreamRequests across every field (tests/harness/hostile_requests.py)
and random bytes in place of requests to every method, and prints how many calls
ended with each status code, how many errors were too big to deliver, whether
health stayed SERVING, and the server's RSS once caches are warm and at the end.
Targets: no UNKNOWN, no INTERNAL, RSS growth under 5%.

    python -m bench.fuzz [--calls 5000] [--raw-calls 1000] [--warmup 2000]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness.hostile_requests import (
    ALLOWED_CODES,
    MAX_ERROR_BYTES,
    generate_requests,
    raw_bytes,
    tokenize_requests,
)
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

METHODS = [
    f"/tokenspout.v1.GenerationService/{name}"
    for name in ("Generate", "Tokenize", "GetModelInfo", "CompileConstraint", "Cancel", "GetServerStatus")
] + ["/grpc.health.v1.Health/Check"]
STREAM_METHOD = "/tokenspout.v1.GenerationService/GenerateStream"


class Tally:
    def __init__(self) -> None:
        self.codes: collections.Counter[str] = collections.Counter()
        self.oversized = 0
        self.examples: dict[str, str] = {}

    def outcome(self, call) -> None:
        """Runs `call` and counts how it ended."""
        try:
            call()
            self.codes["OK"] += 1
        except grpc.RpcError as error:
            code = error.code().name
            self.codes[code] += 1
            if error.code() not in ALLOWED_CODES:
                self.examples.setdefault(code, (error.details() or "")[:200])
            status = rpc_status.from_call(error)
            if status is not None and status.ByteSize() > MAX_ERROR_BYTES:
                self.oversized += 1


def read_some(call, max_messages: int = 4) -> None:
    for count, _ in enumerate(call, 1):
        if count >= max_messages:
            call.cancel()
            return


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fuzz_requests(channel, tally: Tally, count: int) -> None:
    stub = pb_grpc.GenerationServiceStub(channel)

    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=generate_requests())
    def run(request):
        tally.outcome(lambda: read_some(stub.GenerateStream(request, timeout=20)))

    run()


def fuzz_tokenize(channel, tally: Tally, count: int) -> None:
    stub = pb_grpc.GenerationServiceStub(channel)

    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request=tokenize_requests())
    def run(request):
        tally.outcome(lambda: stub.Tokenize(request, timeout=20))

    run()


def fuzz_bytes(channel, tally: Tally, count: int) -> None:
    methods = [STREAM_METHOD, *METHODS]

    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=raw_bytes, method=st.sampled_from(methods))
    def run(data, method):
        if method == STREAM_METHOD:
            tally.outcome(lambda: read_some(channel.unary_stream(method)(data, timeout=10)))
        else:
            tally.outcome(lambda: channel.unary_unary(method)(data, timeout=10))

    run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--raw-calls", type=int, default=1000)
    parser.add_argument("--tokenize-calls", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=2000, help="calls before the warm RSS (fills the caches)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(pathlib.Path(tmp), "--context-length", "512", "--max-batch-size", "4")
        try:
            with grpc.insecure_channel(server.address) as channel:
                fuzz_requests(channel, Tally(), args.warmup)
                warm_rss = rss_mib(server.process.pid)
                tally = Tally()
                start = time.perf_counter()
                trajectory = []
                for chunk in range(0, args.calls, 1000):
                    fuzz_requests(channel, tally, min(1000, args.calls - chunk))
                    trajectory.append(f"{rss_mib(server.process.pid):.0f}")
                fuzz_tokenize(channel, tally, args.tokenize_calls)
                fuzz_bytes(channel, tally, args.raw_calls)
                elapsed = time.perf_counter() - start
                end_rss = rss_mib(server.process.pid)
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        finally:
            exit_code = stop_server(server)
            tracebacks = server.log().count("Traceback")
    total = sum(tally.codes.values())
    print(f"{total} calls in {elapsed:.0f} s ({args.calls} fuzzed requests, {args.tokenize_calls} Tokenize calls, "
          f"{args.raw_calls} raw-byte calls)")
    for code, n in tally.codes.most_common():
        print(f"  {code:<20} {n:>6}")
    print(f"UNKNOWN: {tally.codes['UNKNOWN']}, INTERNAL: {tally.codes['INTERNAL']} (target 0, 0)")
    for code, details in tally.examples.items():
        print(f"  e.g. {code}: {details}")
    print(f"errors over {MAX_ERROR_BYTES} bytes: {tally.oversized}")
    print(f"health at the end: {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}")
    print(f"server RSS: {warm_rss:.0f} MiB warm -> {end_rss:.0f} MiB after, {100 * (end_rss / warm_rss - 1):+.1f}% (target < 5%)")
    print(f"  RSS after each 1000 fuzzed requests: {', '.join(trajectory)} MiB")
    print(f"server exit code {exit_code}, tracebacks in its log: {tracebacks}")


if __name__ == "__main__":
    main()
