"""Hostile callers against a serving replica: what they get back, and what they do to health checks.
Health checks every 10 ms, idle and while four callers loop on large schemas, 1 MB Tokenize texts, 1 MB chats and malformed
bytes; then fuzzing (tests/harness/hostile_requests.py: every request field, Tokenize, raw bytes to every method) after a warm-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from tests.harness.hostile_requests import ALLOWED_CODES, MAX_ERROR_BYTES, generate_requests, raw_bytes, tokenize_requests
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="Robustness",
    smoke=("--seconds", "2", "--warmup", "20", "--calls", "50", "--tokenize-calls", "10", "--raw-calls", "20"),
    order=1,
)
HOSTILE = ("compiles", "tokenizes", "chats", "malformed")
METHODS = [f"/tokenspout.v1.GenerationService/{name}" for name in
           ("Generate", "Tokenize", "GetModelInfo", "CompileConstraint", "Cancel", "GetServerStatus")] + [
    "/grpc.health.v1.Health/Check"]
STREAM_METHOD = "/tokenspout.v1.GenerationService/GenerateStream"


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=20, help="health checks beside the hostile callers")
    parser.add_argument("--only", choices=HOSTILE, help="one hostile caller alone")
    parser.add_argument("--calls", type=int, default=5000, help="fuzzed GenerateStream requests")
    parser.add_argument("--tokenize-calls", type=int, default=500)
    parser.add_argument("--raw-calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=2000, help="fuzzed calls before the warm memory (fills the caches)")


def health_ms(channel, seconds: float) -> list[float]:
    """Milliseconds per health check, one every 10 ms."""
    health = health_pb2_grpc.HealthStub(channel)
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        latencies.append((time.perf_counter() - start) * 1000)
        time.sleep(0.01)
    return latencies


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def hostile_callers(address: str, stop: threading.Event, only: str | None) -> list[threading.Thread]:
    big_text = "lorem ipsum dolor " * 55_000  # about 1 MB
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="word " * 200_000)])

    def compiles(stub):
        n = 0
        while not stop.is_set():
            n += 1
            schema = {"type": "object", "properties": {f"p{n}_{i}": {"type": "string", "pattern": "^[a-z]+$"}
                                                       for i in range(2500)}}
            request = pb.CompileConstraintRequest(constraint=pb.Constraint(json_schema=json.dumps(schema)))
            refused_or_done(lambda request=request: stub.CompileConstraint(request, timeout=30))

    def tokenizes(stub):
        while not stop.is_set():
            refused_or_done(lambda: stub.Tokenize(pb.TokenizeRequest(text=big_text), timeout=30))

    def chats(stub):
        while not stop.is_set():
            refused_or_done(lambda: stub.Generate(pb.GenerateRequest(chat=chat), timeout=30))

    def malformed(channel):
        method = channel.unary_unary("/tokenspout.v1.GenerationService/Generate")
        while not stop.is_set():
            refused_or_done(lambda: method(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))

    threads = []
    for work in (compiles, tokenizes, chats, malformed):
        if only in (None, work.__name__):
            channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
            target = channel if work is malformed else pb_grpc.GenerationServiceStub(channel)
            threads.append(threading.Thread(target=work, args=(target,), daemon=True))
    return threads


def refused_or_done(rpc) -> None:
    try:
        rpc()
    except grpc.RpcError:
        pass  # refusals are expected: only the health checks' latency is measured


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
            self.codes[error.code().name] += 1
            if error.code() not in ALLOWED_CODES:
                self.examples.setdefault(error.code().name, (error.details() or "")[:200])
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


def fuzzed(strategy, count: int, send) -> None:
    """`send` each of `count` examples hypothesis draws from `strategy` (keyword arguments)."""
    settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))(
        given(**strategy)(send))()


def measure(run: Run, args: argparse.Namespace) -> None:
    with Sides() as sides:
        served = sides.tokenspout("--context-length", "512", "--max-batch-size", "4", "--max-input-bytes", str(2 << 20))
        idle = health_ms(served.channel, args.seconds / 4)
        stop = threading.Event()
        threads = hostile_callers(served.address, stop, args.only)
        for thread in threads:
            thread.start()
        loaded = health_ms(served.channel, args.seconds)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        idle += health_ms(served.channel, args.seconds / 4)  # idle again: the machine's noise falls on both sides

        stub, tally = served.stub, Tally()
        fuzzed({"request": generate_requests()}, args.warmup,
               lambda request: Tally().outcome(lambda: read_some(stub.GenerateStream(request, timeout=20))))
        warm = rss_mib(served.pid)
        fuzzed({"request": generate_requests()}, args.calls,
               lambda request: tally.outcome(lambda: read_some(stub.GenerateStream(request, timeout=20))))
        fuzzed({"request": tokenize_requests()}, args.tokenize_calls,
               lambda request: tally.outcome(lambda: stub.Tokenize(request, timeout=20)))

        def send_bytes(data: bytes, method: str) -> None:
            if method == STREAM_METHOD:
                tally.outcome(lambda: read_some(served.channel.unary_stream(method)(data, timeout=10)))
            else:
                tally.outcome(lambda: served.channel.unary_unary(method)(data, timeout=10))

        fuzzed({"data": raw_bytes, "method": st.sampled_from([STREAM_METHOD, *METHODS])}, args.raw_calls, send_bytes)
        end = rss_mib(served.pid)
        health = health_pb2_grpc.HealthStub(served.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        tracebacks = served.server.log().count("Traceback")
    for code, details in tally.examples.items():
        print(f"e.g. {code}: {details}")
    hostile = args.only or "four hostile callers"
    serving = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    run.table("", ["measure", "result"], [
        [f"health check p99, idle / beside {hostile}, ms", f"{p99(idle):.1f} / {p99(loaded):.1f}"],
        [f"fuzzed calls ({args.calls:,} requests, {args.tokenize_calls:,} Tokenize, {args.raw_calls:,} raw bytes): statuses",
         ", ".join(f"`{code}` {n:,}" for code, n in tally.codes.most_common())],
        [f"errors over {MAX_ERROR_BYTES:,} bytes; tracebacks in the log; health at the end; server RSS after the warm-up, "
         "then at the end, MiB", f"{tally.oversized}; {tracebacks}; {serving}; {warm:.0f} to {end:.0f} ({end / warm - 1:+.1%})"],
    ])
    run.target(f"health p99 beside {hostile}, ms", p99(loaded), "<=", 50)
    run.target("fuzzed calls ending UNKNOWN or INTERNAL", tally.codes["UNKNOWN"] + tally.codes["INTERNAL"], "<=", 0)
    run.target("server RSS growth over the fuzzing", end / warm - 1, "<=", 0.05)
