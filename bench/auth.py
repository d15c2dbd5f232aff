"""What API-key authentication costs, one run.

Prints, from two servers on the embedded model (no keys / an API-keys file), measured alternately
so that drift in the machine's speed affects both alike:
  1. single-stream decode tokens/s with a key / without auth (every message passes the auth wrapper)
  2. unary calls (GetModelInfo, one after another): the server's CPU time per call, with a key /
     without auth (CPU time from /proc, so other work on a busy machine does not count), and calls/s
  3. in this process, in CPU time of this thread (which other work on the machine does not inflate):
     the key check (sha256 and compare_digest against every configured key) for 1, 100 and 1,000
     keys, and what the auth wrapper adds to each streamed message

    python -m bench.auth [--tokens 128] [--reps 5] [--calls 2000] [--keys 100]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import pathlib
import statistics
import sys
import tempfile
import time
import timeit

import grpc

from bench.common import PROMPTS, cpu_seconds, greedy_request, timed_request
from service.auth import KeyStore
from service.guard import guarded
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

KEY = "bench-key-0"


def keys_text(count: int) -> str:
    return "".join(f"caller-{i}:{hashlib.sha256(f'bench-key-{i}'.encode()).hexdigest()}\n" for i in range(count))


class Keyed:
    """A stub whose every call carries the bench key."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self._metadata = (("authorization", f"Bearer {KEY}"),)

    def GenerateStream(self, request, timeout=None):
        return self._stub.GenerateStream(request, timeout=timeout, metadata=self._metadata)

    def GetModelInfo(self, request, timeout=None):
        return self._stub.GetModelInfo(request, timeout=timeout, metadata=self._metadata)



def unary_calls(stub, pid: int, calls: int) -> tuple[float, float]:
    """(server CPU microseconds per call, calls per second)."""
    cpu, start = cpu_seconds(pid), time.perf_counter()
    for _ in range(calls):
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    wall = time.perf_counter() - start
    return (cpu_seconds(pid) - cpu) / calls * 1e6, calls / wall


def check_us(keys: int) -> float:
    """Thread CPU microseconds to check one key against `keys` configured ones (median of 5)."""
    store = KeyStore(keys_text(keys).replace("\n", ",").rstrip(","))
    assert store.name_for(f"bench-key-{keys - 1}") == f"caller-{keys - 1}"
    runs = 20_000 // keys + 10
    timer = timeit.Timer(lambda: store.name_for("not-a-key"), timer=time.thread_time)
    return statistics.median(timer.repeat(5, runs)) / runs * 1e6


def wrapper_us_per_message(messages: int = 200_000) -> float:
    """Thread CPU microseconds the auth wrapper adds to one streamed message."""

    async def behavior(request, context):
        for i in range(messages):
            yield i

    handler = grpc.unary_stream_rpc_method_handler(behavior)
    wrapped = guarded(handler, lambda context: None).unary_stream

    async def consume(stream) -> float:
        start = time.thread_time()
        async for _ in stream(None, None):
            pass
        return time.thread_time() - start

    plain = statistics.median(asyncio.run(consume(behavior)) for _ in range(5))
    guarded_s = statistics.median(asyncio.run(consume(wrapped)) for _ in range(5))
    return (guarded_s - plain) / messages * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=100, help="keys in the server's file")
    args = parser.parse_args()
    flags = ("--max-batch-size", "1", "--context-length", "1024")
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = pathlib.Path(tmp) / "api-keys"
        keys_file.write_text(keys_text(args.keys))
        plain = start_server(pathlib.Path(tmp), *flags)
        keyed = start_server(pathlib.Path(tmp), *flags, "--api-keys-file", str(keys_file))
        try:
            with grpc.insecure_channel(plain.address) as a, grpc.insecure_channel(keyed.address) as b:
                stubs = {"off": pb_grpc.GenerationServiceStub(a), "key": Keyed(pb_grpc.GenerationServiceStub(b))}
                pids = {"off": plain.process.pid, "key": keyed.process.pid}
                for name, stub in stubs.items():  # warm both
                    timed_request(stub, greedy_request(PROMPTS[0], 8))
                    unary_calls(stub, pids[name], 20)
                decode = {name: [] for name in stubs}
                unary = {name: [] for name in stubs}
                for rep in range(args.reps):
                    order = list(stubs) if rep % 2 == 0 else list(reversed(stubs))
                    for name in order:
                        decode[name].append(timed_request(stubs[name], greedy_request(PROMPTS[rep % 8], args.tokens))[1])
                        unary[name].append(unary_calls(stubs[name], pids[name], args.calls))
        finally:
            stop_server(plain)
            stop_server(keyed)
    off, on = statistics.median(decode["off"]), statistics.median(decode["key"])
    print(f"{args.reps} streams of {args.tokens} greedy tokens and {args.reps} x {args.calls} GetModelInfo calls "
          f"each way, alternating; the keyed server has {args.keys} keys")
    print(f"decode, one stream:   {on:7.1f} tok/s with a key vs {off:7.1f} without auth: ratio {on / off:.3f}")
    off, on = (statistics.median(cpu for cpu, _ in unary[name]) for name in ("off", "key"))
    print(f"unary call, server CPU: {on:7.1f} us with a key vs {off:7.1f} without auth: +{on - off:.1f} us")
    off, on = (statistics.median(rate for _, rate in unary[name]) for name in ("off", "key"))
    print(f"unary calls:          {on:7.1f} /s with a key vs {off:7.1f} without auth: ratio {on / off:.3f}")
    for keys in (1, 100, 1000):
        print(f"key check, {keys:5d} keys: {check_us(keys):7.1f} us (thread CPU)")
    print(f"auth wrapper per streamed message: {wrapper_us_per_message():.2f} us (thread CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
