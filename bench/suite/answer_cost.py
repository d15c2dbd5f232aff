"""What keeping answers costs chats that never continue.
Only `prefix_cache_exact` has this cost: 24 single-turn chats of 128 greedy tokens, 8 at a time, on exact-reuse servers
with `prefix_cache_generated` on and off, alternated, idle work ended first. No answer is asked for again.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

from bench.harness.pairing import alternate, span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import THREADS, Sides
from bench.harness.streams import settle
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="Prefix cache and affinity",
    smoke=("--reps", "1", "--chats", "8", "--tokens", "16"),
    order=5,
)
STREAMS = 8


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--chats", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=128)


def chats_rate(stub, rep: int, chats: int, tokens: int) -> float:
    """Decode tokens/s of `chats` unique single-turn chats, STREAMS at a time; then waits out the server's idle work."""
    requests = [pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=f"Story {rep}-{i}: tell me about a {i}-legged robot.")]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    ) for i in range(chats)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        generated = sum(pool.map(lambda r: list(stub.GenerateStream(r, timeout=600))[-1].generated_tokens, requests))
    rate = generated / (time.perf_counter() - start)
    settle(stub)
    return rate


def measure(run: Run, args: argparse.Namespace) -> None:
    flags = ("--max-batch-size", str(STREAMS), "--threads", str(THREADS), "--prefix-cache-exact")
    with Sides() as sides:
        stubs = {"on": sides.tokenspout(*flags).stub, "off": sides.tokenspout(*flags, "--prefix-cache-generated", "false").stub}
        rates = alternate({side: (lambda rep, stub=stub: chats_rate(stub, rep, args.chats, args.tokens))
                           for side, stub in stubs.items()}, range(args.reps))
        retiled = stubs["on"].GetServerStatus(pb.GetServerStatusRequest()).retiled_tokens_total
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    run.table("", ["on, tok/s", "off, tok/s", "on / off, per rep", "median", "tokens computed again / generated"], [[
        round(statistics.median(rates["on"]), 1), round(statistics.median(rates["off"]), 1), span(ratios),
        round(statistics.median(ratios), 3),
        f"{retiled:,} / {args.reps * args.chats * args.tokens:,}"]])
    run.target("decode tokens/s, prefix_cache_generated on / off, median of reps", statistics.median(ratios), ">=", 0.95)
