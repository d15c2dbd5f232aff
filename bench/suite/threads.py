"""Which `threads` default survives a shared machine: every core, every core but one, or the engine's choice (0).
A server per setting, in turn: its first 400-token prompts (ms), then after 256 tokens tok/s and first token; quiet, then busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.harness.pairing import rotated
from bench.harness.prompt_kinds import clauses
from bench.harness.record import Benchmark, Run
from bench.harness.sides import CONTEXT, SLOTS, Sides
from bench.harness.streams import aggregate_rate, timed_stream
from bench.suite.first_token import first_token_s

BENCHMARK = Benchmark(
    area="Threads",
    smoke=("--settings", "0", "--reps", "1", "--tokens", "8", "--warm-tokens", "8", "--first-tokens", "2", "--cold-prompts", "1"),
    order=1,
)
LOADS = ("quiet", "busy")


def arguments(parser: argparse.ArgumentParser) -> None:
    cores = os.cpu_count() or 1
    every = ",".join(str(n) for n in [*sorted({max(1, cores - 1), cores}), 0])
    parser.add_argument("--settings", default=every, help=f"`threads` values, comma-separated (here {every}; 0: adaptive)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="tokens a stream")
    parser.add_argument("--warm-tokens", type=int, default=256, help="decoded first: the adaptive setting probes")
    parser.add_argument("--first-tokens", type=int, default=8, help="first-token requests a measure")
    parser.add_argument("--cold-prompts", type=int, default=4, help="~400-token prompts a fresh server computes first")


def spin(stop) -> None:  # type: ignore[no-untyped-def]
    while not stop.is_set():
        sum(range(10_000))


@contextmanager
def load(busy: bool) -> Iterator[None]:
    """One process wanting a core for as long as the block runs, when `busy`."""
    stop = multiprocessing.Event()
    hog = multiprocessing.Process(target=spin, args=(stop,)) if busy else None
    if hog:
        hog.start()
    try:
        yield
    finally:
        if hog:
            stop.set()
            hog.join()




def one_setting(threads: int, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(median cold prompt s, 1-stream tok/s, 8-stream tok/s, median first token s) of a fresh server with `threads`."""
    with Sides() as sides:
        stub = sides.tokenspout("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(threads)).stub
        # A fresh server's first long prompts, each its own (nothing cached), answered with one token.
        cold = statistics.median(first_token_s(stub, clauses(f"cold {i}"), tokens=1) for i in range(args.cold_prompts))
        timed_stream(stub, "Warm up", args.warm_tokens)
        single = statistics.median(timed_stream(stub, "The history of the printing press", args.tokens)[1] for _ in range(2))
        eight = aggregate_rate(stub, 8, args.tokens)
        first = statistics.median(first_token_s(stub, f"Question {i}: why is the sky blue?", tokens=4)
                                  for i in range(args.first_tokens))
        return cold, single, eight, first


def measure(run: Run, args: argparse.Namespace) -> None:
    settings = [int(n) for n in args.settings.split(",")]
    figures: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for busy in (False, True):
        with load(busy):
            for rep in range(args.reps):
                for threads in rotated(settings, rep):
                    figures.setdefault((LOADS[busy], threads), []).append(one_setting(threads, args))
        time.sleep(1)
    rows: list[list] = []
    for threads in settings:
        row: list = [f"{threads} (adaptive)" if threads == 0 else threads]
        for kind in LOADS:
            cold, single, eight, first = (statistics.median(r[i] for r in figures[(kind, threads)]) for i in range(4))
            row += [round(cold * 1000), round(single, 1), round(eight, 1), round(first * 1000, 1)]
        rows.append(row)
    columns = ["threads", "quiet: cold prompt", "1 stream", "8 streams", "first token",
               "busy: cold prompt", "1 stream", "8 streams", "first token"]
    run.table("", columns, rows)
    if 0 in settings and len(settings) > 1:  # the adaptive default against the best fixed count, column by column
        fixed = [row for row, threads in zip(rows, settings) if threads]
        adaptive = rows[settings.index(0)]
        shares = []
        for i, name in enumerate(columns[1:], 1):
            if "stream" in name:  # tokens/s: more is better
                shares.append(adaptive[i] / max(r[i] for r in fixed))
            else:  # milliseconds
                shares.append(min(r[i] for r in fixed) / adaptive[i])
        quiet, busy = (" / ".join(f"{share:.2f}" for share in half) for half in (shares[:4], shares[4:]))
        run.note(f"No target. The adaptive default's speed over the best fixed count's (cold prompt, 1 stream, 8 streams, "
                 f"first token): quiet {quiet}, busy {busy}.")
