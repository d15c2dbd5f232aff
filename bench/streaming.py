"""Streaming benchmark on the embedded model, every figure from one run.

Prints:
  1. single-stream decode tokens/s through gRPC / the same engine driven in-process (target >= 0.97)
  2. time to first token added by gRPC, median (target <= 5 ms)
  3. aggregate tokens/s at 1, 2, 4 and 8 concurrent streams through gRPC, start to last token, and
     its two phases: until the last stream's first token (the prompts), and from then to the end
     (decode tokens/s: every stream's tokens after its first, over that time)
  4. with --llama-server PATH: the same from llama.cpp's own C++ server on the same GGUF at its defaults
     (`cache_prompt` on), and ours divided by it (target >= 1.0 at every concurrency)
  5. time to first token at 1 and 8 concurrent streams, for short prompts that share nothing with any
     other and for prompts that each extend one of the burst before by a few words (bench.prompt_kinds),
     and with --llama-server, its time divided by ours (speed: higher is better, target >= 1.0)

    python -m bench.streaming [--tokens 128] [--reps 5] [--threads 2] [--llama-server PATH [--llama-server-args FLAGS]]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import queue
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import grpc

from backend.common.models import default_model_path
from backend.config import EngineConfig
from backend.llamacpp.engine import LlamaCppEngine
from backend.types import GenerationRequest, SamplingParams, StopParams
from bench.common import greedy_request, timed_stream
from bench.llama_server import LlamaServer, start_llama_server
from bench.prompt_kinds import extended, fresh_prompts
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROMPTS = [
    "The history of the printing press",
    "How do volcanoes form?",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a child.",
    "The rules of chess are",
    "A recipe for bread:",
    "Why do cats purr?",
    "The planets of the solar system",
]
CONTEXT, SLOTS, THREADS = 1024, 8, 2
CONCURRENCY = (1, 2, 4, 8)


class Burst(NamedTuple):
    """First-token times of a burst of concurrent streams."""

    median_s: float
    slowest_s: float


def engine_run(engine: LlamaCppEngine, prompt: str, tokens: int) -> tuple[float, float]:
    """One greedy stream in-process: (seconds to first token, decode tokens/s)."""
    events: queue.Queue = queue.Queue()
    request = GenerationRequest(
        f"bench-{time.monotonic_ns()}",
        tuple(engine.tokenize(prompt)),
        SamplingParams(temperature=0.0),
        StopParams(max_new_tokens=tokens, ignore_eos=True),
        speculation=engine.info.default_speculation,  # as the server fills in for a request that names none
    )
    start = time.perf_counter()
    engine.submit(request, lambda event: events.put((time.perf_counter(), event)))
    stamps = []
    while True:
        stamp, event = events.get()
        stamps.append(stamp)
        if event.finish is not None:
            break
    return stamps[0] - start, (tokens - 1) / (stamps[-1] - stamps[0])


class Phases(NamedTuple):
    """A burst of concurrent streams, all started together."""

    aggregate: float
    """Tokens/s, start to the last token."""
    prompts_s: float
    """Until the last stream's first token."""
    decode: float
    """Every stream's tokens after its first, over the time from the last first token to the end."""


def burst_phases(first_token_s: Callable[[str], float], streams: int, tokens: int) -> Phases:
    """`streams` concurrent streams of `tokens` tokens, one per prompt; `first_token_s` runs one to its end
    and returns its time to first token."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        prompts_s = max(pool.map(first_token_s, PROMPTS[:streams]))
    whole = time.perf_counter() - start
    return Phases(streams * tokens / whole, prompts_s, streams * (tokens - 1) / (whole - prompts_s))


def our_first_token_s(stub, tokens: int) -> Callable[[str], float]:
    return lambda prompt: timed_stream(stub, prompt, tokens)[0]


def llama_server_first_token_s(server: LlamaServer, tokens: int) -> Callable[[str], float]:
    """The same through llama-server's streaming (SSE) completion endpoint."""

    def one(prompt: str) -> float:
        completion = server.stream(prompt, tokens)  # at its defaults: cache_prompt on
        assert completion.tokens >= tokens, completion.tokens
        return completion.ttft_s

    return one


KINDS = ("fresh", "extends")


def ttft_comparison(stub, reference: LlamaServer | None, reps: int) -> dict[tuple[int, str], tuple[Burst, Burst | None]]:
    """Time to first token of N concurrent 8-token streams, N in (1, 8), for each server and each kind of prompt:
    a burst of N prompts that share nothing, then a burst of N prompts each extending one of those by a few
    words; the medians over reps of each burst's median and of its slowest. Each server runs both bursts in
    turn, and goes first in every other rep."""

    def our_first(prompt: str) -> float:
        start = time.perf_counter()
        first = None
        for message in stub.GenerateStream(greedy_request(prompt, 8), timeout=300):  # read to the end, as for llama-server
            if message.generated_tokens and first is None:
                first = time.perf_counter() - start
        return first

    def burst(pool, first_token, prompts) -> tuple[float, float]:
        times = list(pool.map(first_token, prompts))
        return statistics.median(times), max(times)

    summary = lambda bursts: Burst(*(statistics.median(column) for column in zip(*bursts)))  # noqa: E731
    sides: list[Callable[[str], float]] = [our_first]
    if reference is not None:
        sides.append(lambda p: reference.stream(p, 8).ttft_s)  # at its defaults: cache_prompt on
    fresh = iter(fresh_prompts(reps * 9, seed=time.monotonic_ns()))
    results = {}
    for streams in (1, 8):
        bursts: dict[str, list[list[tuple[float, float]]]] = {kind: [[] for _ in sides] for kind in KINDS}
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            for rep in range(reps):
                prompts = [next(fresh) for _ in range(streams)]
                by_kind = {"fresh": prompts, "extends": [extended(p, rep + i) for i, p in enumerate(prompts)]}
                for side in (range(len(sides)) if rep % 2 == 0 else reversed(range(len(sides)))):
                    for kind in KINDS:
                        bursts[kind][side].append(burst(pool, sides[side], by_kind[kind]))
        for kind in KINDS:
            per_side = [summary(b) for b in bursts[kind]]
            results[(streams, kind)] = (per_side[0], per_side[1] if reference is not None else None)
    return results


def aggregate_comparison(stub, reference_server, args) -> tuple[dict[int, Phases], dict[int, Phases]]:
    """Medians of each burst figure per concurrency, alternating the two servers so noise hits both alike."""
    ours: dict[int, list[Phases]] = {n: [] for n in CONCURRENCY}
    reference: dict[int, list[Phases]] = {n: [] for n in CONCURRENCY}
    if reference_server is not None:
        burst_phases(llama_server_first_token_s(reference_server, 8), 1, 8)  # warm-up
    for _ in range(args.reps):
        for n in CONCURRENCY:
            ours[n].append(burst_phases(our_first_token_s(stub, args.tokens), n, args.tokens))
            if reference_server is not None:
                reference[n].append(burst_phases(llama_server_first_token_s(reference_server, args.tokens), n, args.tokens))
    median = lambda runs: {  # noqa: E731
        n: Phases(*(statistics.median(column) for column in zip(*bursts))) for n, bursts in runs.items() if bursts
    }
    return median(ours), median(reference)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ttft-reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=THREADS, help="for both servers")
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server binary, for the reference")
    parser.add_argument("--llama-server-args", default="",
                        help="its extra flags, e.g. bench.speculation.BEST_SPEC (default none: on these prompts it "
                             "decodes fastest plain, docs/benchmarks.md)")
    args = parser.parse_args()
    model = default_model_path()
    print(f"model {model.name}, {args.threads} threads, {SLOTS} slots, {args.tokens} tokens per stream, {os.cpu_count()} cores")

    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    server = start_server(tmp, "--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(args.threads))
    engine = LlamaCppEngine(model, EngineConfig.of(context_length=CONTEXT, max_batch_size=SLOTS, threads=args.threads))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            timed_stream(stub, PROMPTS[0], 8)  # warm both paths
            engine_run(engine, PROMPTS[0], 8)
            # Alternate the two so that machine noise hits both alike.
            direct, through_grpc = [], []
            for _ in range(args.reps):
                direct.append(engine_run(engine, PROMPTS[0], args.tokens)[1])
                through_grpc.append(timed_stream(stub, PROMPTS[0], args.tokens)[1])
            d, g = statistics.median(direct), statistics.median(through_grpc)
            print(f"single stream decode: in-process {d:.1f} tok/s, gRPC {g:.1f} tok/s, ratio {g / d:.3f} (target >= 0.97)")

            ttft_direct, ttft_grpc = [], []
            for _ in range(args.ttft_reps):
                ttft_direct.append(engine_run(engine, PROMPTS[1], 2)[0])
                ttft_grpc.append(timed_stream(stub, PROMPTS[1], 2)[0])
            added = (statistics.median(ttft_grpc) - statistics.median(ttft_direct)) * 1000
            print(
                f"time to first token: in-process {statistics.median(ttft_direct) * 1000:.1f} ms, "
                f"gRPC {statistics.median(ttft_grpc) * 1000:.1f} ms, added {added:.2f} ms median (target <= 5)"
            )

            reference_server = (
                start_llama_server(args.llama_server, model, CONTEXT, SLOTS, args.threads, args.llama_server_args.split())
                if args.llama_server else None
            )
            try:
                ours, reference = aggregate_comparison(stub, reference_server, args)
                ttfts = ttft_comparison(stub, reference_server, args.ttft_reps)
            finally:
                if reference_server is not None:
                    reference_server.stop()
    finally:
        engine.close()
        stop_server(server)

    print("aggregate tokens/s by concurrent streams (medians: start to last token; prompts until the last first"
          " token; decode tokens/s after it):")
    for n, burst in ours.items():
        line = f"  {n} streams: tokenspout {burst.aggregate:.1f} ({burst.prompts_s * 1000:.0f} ms, {burst.decode:.1f})"
        if reference:
            theirs = reference[n]
            line += (f", llama-server {theirs.aggregate:.1f} ({theirs.prompts_s * 1000:.0f} ms, {theirs.decode:.1f}), "
                     f"ratio {burst.aggregate / theirs.aggregate:.2f} (target >= 1.0; decode phase "
                     f"{burst.decode / theirs.decode:.2f})")
        print(line)
    print("time to first token by concurrent streams and prompt kind (median over reps of each burst's median / slowest):")
    for (n, kind), (mine, theirs) in ttfts.items():
        line = f"  {n} streams, {kind}: tokenspout {mine.median_s * 1000:.1f} / {mine.slowest_s * 1000:.1f} ms"
        if theirs is not None:
            line += (f", llama-server {theirs.median_s * 1000:.1f} / {theirs.slowest_s * 1000:.1f} ms, speed "
                     f"{theirs.median_s / mine.median_s:.2f} / {theirs.slowest_s / mine.slowest_s:.2f} (target >= 1.0)")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
