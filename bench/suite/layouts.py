"""llama.cpp on the CPU: the engine in a process of its own against the engine in the server's process.
The same llama.cpp server both ways, bursts to each in turn: the first token of fresh short prompts sent at once, decode tokens/s
after the last stream's first token. Speed: split / in-process (first token: in-process time over the split's); 1.0: no cost."""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

from bench.harness.pairing import rotated
from bench.harness.record import Benchmark, Run
from bench.harness.sides import SERVER_FLAGS, Sides
from bench.harness.streams import PROMPTS, greedy_request
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="The engine in a process of its own",
    smoke=("--reps", "1", "--tokens", "8", "--streams", "1"),
    order=2,
)
SIDES = {"split": (), "in-process": ("--engine-process", "false")}
TARGET = 0.98
"""split / in-process speed, every measure: the split costs llama.cpp on the CPU nothing that shows."""


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="tokens a stream for decode")
    parser.add_argument("--streams", default="1,8", help="streams at once, comma-separated")


def first_token_at(stub: pb_grpc.GenerationServiceStub, prompt: str, tokens: int) -> float:
    """When the stream's first token came (it is read to its end)."""
    first = None
    for message in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300):
        if message.generated_tokens and first is None:
            first = time.perf_counter()
    assert first is not None
    return first


def burst_first_tokens(stub: pb_grpc.GenerationServiceStub, streams: int, rep: int) -> float:
    """The median first-token time of `streams` fresh short prompts sent at once."""
    prompts = [f"Request {rep}-{i} of {time.monotonic_ns()}: {PROMPTS[i % len(PROMPTS)]}" for i in range(streams)]

    def first_token_s(prompt: str) -> float:
        start = time.perf_counter()
        return first_token_at(stub, prompt, 8) - start

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        return statistics.median(pool.map(first_token_s, prompts))


def decode_rate(stub: pb_grpc.GenerationServiceStub, streams: int, tokens: int) -> float:
    """Tokens/s of `streams` concurrent greedy streams after the last one's first token."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {time.monotonic_ns()}" for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        last_first = max(pool.map(lambda prompt: first_token_at(stub, prompt, tokens), prompts))
    return streams * (tokens - 1) / (time.perf_counter() - last_first)


def measure(run: Run, args: argparse.Namespace) -> None:
    rows: list[list] = []
    speeds = []
    with Sides() as sides:
        stubs = {side: sides.tokenspout(*SERVER_FLAGS, *flags).stub for side, flags in SIDES.items()}
        for stub in stubs.values():  # warm: first calls, the threads' tuning
            decode_rate(stub, 2, min(16, args.tokens))
        for streams in (int(n) for n in args.streams.split(",")):
            firsts: dict[str, list[float]] = {side: [] for side in SIDES}
            rates: dict[str, list[float]] = {side: [] for side in SIDES}
            for rep in range(args.reps):
                order = rotated(list(SIDES), rep)
                for side in order:
                    firsts[side].append(burst_first_tokens(stubs[side], streams, rep))
                for side in order:
                    rates[side].append(decode_rate(stubs[side], streams, args.tokens))
            first = {side: statistics.median(times) * 1e3 for side, times in firsts.items()}
            rate = {side: statistics.median(values) for side, values in rates.items()}
            speeds += [first["in-process"] / first["split"], rate["split"] / rate["in-process"]]
            rows.append([streams, f"{first['split']:.1f} / {first['in-process']:.1f}", f"{speeds[-2]:.3f}",
                         f"{rate['split']:.1f} / {rate['in-process']:.1f}", f"{speeds[-1]:.3f}"])
    run.table("", ["streams at once", "first token, ms, split / in-process (medians)", "speed",
                   "decode, tokens/s, split / in-process", "speed"], rows)
    run.target("speed, split / in-process, the lowest measure", min(speeds), ">=", TARGET)
