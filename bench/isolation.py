"""Health-check latency while hostile callers load the server, against the same server idle.

Four hostile callers run in a loop: one sends large distinct JSON schemas to
compile, one sends multi-megabyte Tokenize texts, one long chats (tokenized off
the event loop), and one malformed request bytes. Meanwhile a prober sends
health checks and records their latency. Target: p99 under 50 ms.

    python -m bench.isolation [--seconds 20] [--only compiles|tokenizes|chats|malformed]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def probe_health(channel, seconds: float) -> list[float]:
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


def hostile_callers(address: str, stop: threading.Event, only: str = "") -> tuple[list[threading.Thread], dict[str, int]]:
    counts = {"compiles": 0, "tokenizes": 0, "chats": 0, "malformed": 0}
    big_text = "lorem ipsum dolor " * 55_000  # about 1 MB
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="word " * 200_000)])

    def compiles(stub):
        n = 0
        while not stop.is_set():
            n += 1
            properties = {f"p{n}_{i}": {"type": "string", "pattern": "^[a-z]+$"} for i in range(2500)}
            schema = {"type": "object", "properties": properties}
            request = pb.CompileConstraintRequest(constraint=pb.Constraint(json_schema=json.dumps(schema)))
            call(lambda request=request: stub.CompileConstraint(request, timeout=30))
            counts["compiles"] += 1

    def tokenizes(stub):
        while not stop.is_set():
            call(lambda: stub.Tokenize(pb.TokenizeRequest(text=big_text), timeout=30))
            counts["tokenizes"] += 1

    def chats(stub):
        while not stop.is_set():
            call(lambda: stub.Generate(pb.GenerateRequest(chat=chat), timeout=30))
            counts["chats"] += 1

    def malformed(channel):
        method = channel.unary_unary("/tokenspout.v1.GenerationService/Generate")
        while not stop.is_set():
            call(lambda: method(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))
            counts["malformed"] += 1

    threads = []
    for work in (compiles, tokenizes, chats, malformed):
        if only and work.__name__ != only:
            continue
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        target = channel if work is malformed else pb_grpc.GenerationServiceStub(channel)
        threads.append(threading.Thread(target=work, args=(target,), daemon=True))
    return threads, counts


def call(rpc) -> None:
    try:
        rpc()
    except grpc.RpcError:
        pass  # refusals are expected; only the prober's latency is measured


def percentiles(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"p50 {statistics.median(ordered):.1f} ms, p99 {p99:.1f} ms, max {ordered[-1]:.1f} ms ({len(ordered)} checks)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--only", choices=["compiles", "tokenizes", "chats", "malformed"], help="one hostile caller alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(pathlib.Path(tmp), "--max-input-bytes", str(2 << 20))
        try:
            with grpc.insecure_channel(server.address) as channel:
                idle = probe_health(channel, args.seconds / 2)
                stop = threading.Event()
                threads, counts = hostile_callers(server.address, stop, args.only or "")
                for thread in threads:
                    thread.start()
                loaded = probe_health(channel, args.seconds)
                stop.set()
                for thread in threads:
                    thread.join(timeout=60)
        finally:
            stop_server(server)
    print(f"idle:                 {percentiles(idle)}")
    print(f"{args.only or '4 hostile callers'}: {percentiles(loaded)}  (target p99 < 50 ms)")
    print("hostile calls made:   " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
