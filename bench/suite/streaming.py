"""Aggregate tokens/s and first tokens of concurrent streams, against llama-server at its defaults.
Greedy streams started together, to each server in turn; prompts: ms to the last first token; decode phase: tokens/s after.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

from bench.harness.llama_server import LlamaServer
from bench.harness.pairing import rotated
from bench.harness.prompt_kinds import extended, fresh_prompts
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import timed_stream
from bench.suite.first_token import first_token_s
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="Time to first token and decode against llama-server",
    needs=("llama-server",),
    smoke=("--reps", "1", "--ttft-reps", "1", "--tokens", "4", "--streams", "1,2"),
    order=0,
)
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
KINDS = ("fresh", "extends")
SIDES = ("tokenspout", "llama-server")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=64, help="tokens a stream, for the aggregate")
    parser.add_argument("--reps", type=int, default=3, help="bursts at each stream count, for the aggregate")
    parser.add_argument("--ttft-reps", type=int, default=10, help="bursts of each kind, for the first tokens")
    parser.add_argument("--streams", default="1,2,4,8", help="concurrent streams (8 at most), comma-separated")
    parser.add_argument("--llama-server-args", default="", help="its extra flags (default none: on these prompts it "
                        "decodes fastest plain)")


class Phases(NamedTuple):
    """A burst of concurrent streams, all started together."""

    aggregate: float
    """Tokens/s, start to the last token."""
    prompts_s: float
    """Until the last stream's first token."""
    decode: float
    """Every stream's tokens after its first, over the time from the last first token to the end."""


def burst_phases(first_token: Callable[[str], float], streams: int, tokens: int) -> Phases:
    """`streams` concurrent streams, one per prompt; `first_token` runs one to its end and returns its first token's time."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        prompts_s = max(pool.map(first_token, PROMPTS[:streams]))
    whole = time.perf_counter() - start
    return Phases(streams * tokens / whole, prompts_s, streams * (tokens - 1) / (whole - prompts_s))


def ours(stub: pb_grpc.GenerationServiceStub, tokens: int) -> Callable[[str], float]:
    return lambda prompt: timed_stream(stub, prompt, tokens)[0]


def theirs(server: LlamaServer, tokens: int) -> Callable[[str], float]:
    def one(prompt: str) -> float:
        completion = server.stream(prompt, tokens)  # at its defaults: cache_prompt on
        assert completion.tokens >= tokens, completion.tokens
        return completion.ttft_s

    return one


def aggregates(stub, reference: LlamaServer, counts: list[int], args: argparse.Namespace) -> dict[str, dict[int, Phases]]:  # type: ignore[no-untyped-def]
    """Each side's medians of each burst figure per stream count, the sides alternating burst by burst."""
    sides = {"tokenspout": ours(stub, args.tokens), "llama-server": theirs(reference, args.tokens)}
    runs: dict[str, dict[int, list[Phases]]] = {side: {n: [] for n in counts} for side in sides}
    for turn in range(args.reps * len(counts)):
        n = counts[turn % len(counts)]
        for side in rotated(list(sides), turn):
            runs[side][n].append(burst_phases(sides[side], n, args.tokens))
    return {side: {n: Phases(*map(statistics.median, zip(*bursts))) for n, bursts in by_n.items()} for side, by_n in runs.items()}


def first_tokens(stub, reference: LlamaServer, streams: int, reps: int) -> dict[tuple[str, str], tuple[float, float]]:  # type: ignore[no-untyped-def]
    """(kind, side): the medians over reps of each burst's median and slowest first token. Each side runs a burst
    of `streams` fresh prompts, then a burst extending them, the sides' order rotating rep by rep."""
    sides = {"tokenspout": lambda p: first_token_s(stub, p), "llama-server": lambda p: reference.stream(p, 8).ttft_s}
    fresh = iter(fresh_prompts(reps * streams, seed=time.monotonic_ns()))
    bursts: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        for rep in range(reps):
            prompts = [next(fresh) for _ in range(streams)]
            by_kind = {"fresh": prompts, "extends": [extended(p, rep + i) for i, p in enumerate(prompts)]}
            for side in rotated(list(sides), rep):
                for kind in KINDS:
                    times = list(pool.map(sides[side], by_kind[kind]))
                    bursts.setdefault((kind, side), []).append((statistics.median(times), max(times)))
    return {key: (statistics.median(b[0] for b in runs), statistics.median(b[1] for b in runs)) for key, runs in bursts.items()}


def measure(run: Run, args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.streams.split(",")]
    most = max(counts)
    with Sides() as sides:
        stub = sides.tokenspout().stub
        reference = sides.llama_server(args.llama_server, *args.llama_server_args.split())
        burst_phases(ours(stub, 8), 1, 8)  # warm both
        burst_phases(theirs(reference, 8), 1, 8)
        rates = aggregates(stub, reference, counts, args)
        firsts = first_tokens(stub, reference, most, args.ttft_reps)
    mine, its = rates["tokenspout"], rates["llama-server"]
    run.table("", ["streams", f"tok/s, {args.tokens} a stream", "llama-server", "ratio", "prompts, ms", "llama-server",
                   "decode phase, tok/s", "llama-server", "ratio"],
              [[n, round(mine[n].aggregate, 1), round(its[n].aggregate, 1), round(mine[n].aggregate / its[n].aggregate, 2),
                round(mine[n].prompts_s * 1000), round(its[n].prompts_s * 1000), round(mine[n].decode, 1),
                round(its[n].decode, 1), round(mine[n].decode / its[n].decode, 2)] for n in counts])
    ours_range = [mine[n].aggregate for n in counts]
    run.note(f"{args.reps} reps. Ours {min(ours_range):.0f}-{max(ours_range):.0f} tokens/s from {counts[0]} to {most} streams; "
             f"llama-server's {its[counts[0]].aggregate:.0f} at {counts[0]}, {its[most].aggregate:.0f} at {most}.")
    run.plot("aggregate tokens/s against concurrent streams", "concurrent streams", "tokens/s",
             {side: [(n, rates[side][n].aggregate) for n in counts] for side in SIDES}, log_x=True)
    speeds = {kind: firsts[(kind, "llama-server")][0] / firsts[(kind, "tokenspout")][0] for kind in KINDS}
    rows: list[list] = []
    for kind in KINDS:
        (median, slowest), (their_median, their_slowest) = firsts[(kind, "tokenspout")], firsts[(kind, "llama-server")]
        rows.append([kind, f"{median * 1000:.0f} / {slowest * 1000:.0f}", f"{their_median * 1000:.0f} / "
                     f"{their_slowest * 1000:.0f}", f"{speeds[kind]:.2f} / {their_slowest / slowest:.2f}"])
    run.table("", [f"{most} at once, prompt", "first token ms, median / slowest", "llama-server", "speed"], rows)
    run.target("aggregate tokens/s / llama-server's, the lowest over the stream counts",
               min(mine[n].aggregate / its[n].aggregate for n in counts), ">=", 1.0)
    run.target(f"first token of {most} at once, the burst's median, speed, the lower of the two kinds",
               min(speeds.values()), ">=", 1.0)
