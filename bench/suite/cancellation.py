"""What a cancelled call and a slow reader cost the others.
Cancels after 5 messages: engine steps and ms until the cache is freed (the server's figures; the caller's, polling its status).
Then 8 streams alone against the same 8 beside a 9th caller reading one message a second (paused while its buffer is full).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import grpc

from bench.harness.pairing import alternate
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import PROMPTS, aggregate_rate, greedy_request
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(area="Robustness", smoke=("--cancels", "3", "--reps", "1", "--tokens", "16"), order=2)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cancels", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3, help="8 streams alone and beside the slow reader, alternated")
    parser.add_argument("--tokens", type=int, default=128)


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
            return status.last_cancel_latency_steps, status.last_cancel_latency_ms, (time.perf_counter() - start) * 1000


def beside_slow_reader(stub, address: str, tokens: int) -> tuple[float, float]:
    """Tokens/s of the 8 streams while a 9th caller reads one message per second, and the tokens/s of all nine
    (the slow reader still gets what it reads)."""
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
        start, before = time.perf_counter(), received[-1]
        rate = aggregate_rate(stub, len(PROMPTS), tokens)
        return rate, rate + (received[-1] - before) / (time.perf_counter() - start)
    finally:
        stop.set()
        slow.cancel()
        reader.join()
        channel.close()


def measure(run: Run, args: argparse.Namespace) -> None:
    everyone: list[float] = []

    with Sides() as sides:
        served = sides.tokenspout("--max-batch-size", "9", "--context-length", "1024", "--stream-buffer-events", "16")
        cancels = [cancel_latency(served.stub) for _ in range(args.cancels)]

        def beside(_):
            eight, nine = beside_slow_reader(served.stub, served.address, args.tokens)
            everyone.append(nine)
            return eight

        rates = alternate({"alone": lambda _: aggregate_rate(served.stub, len(PROMPTS), args.tokens), "beside": beside},
                          range(args.reps))
    ratios = [b / a for a, b in zip(rates["alone"], rates["beside"], strict=True)]
    counting = [n / a for a, n in zip(rates["alone"], everyone, strict=True)]
    run.table("", ["measure", "result"], [
        [f"cancel to cache freed: engine steps (max of {args.cancels}); median ms, server / caller",
         f"{max(s for s, _, _ in cancels)}; {statistics.median(ms for _, ms, _ in cancels):.1f} / "
         f"{statistics.median(ms for _, _, ms in cancels):.1f}"],
        ["8 streams' tokens/s beside a caller reading 1 message/s / alone; counting the slow reader's",
         f"{statistics.median(ratios):.3f}; {statistics.median(counting):.3f}"],
    ])
    run.target("engine steps from a cancel to its cache freed, most", max(s for s, _, _ in cancels), "<=", 1)
    run.target("8 streams beside a slow reader / alone", statistics.median(ratios), ">=", 0.95)
