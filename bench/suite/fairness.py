"""Fair sharing against first come, first served: what one caller's flood does to the others.
Two servers alike but for `scheduling` (batch 8, context 512), in turns: callers keeping 1, 4 and 16 greedy streams open (Jain's
index among those left waiting), then an interactive caller's short questions, idle and beside another caller's 30-stream flood.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import threading
import time

import grpc

from bench.harness.pairing import rotated
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import PROMPTS, greedy_request
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="Fair sharing",
    smoke=("--seconds", "1.5", "--warmup", "0.5", "--rounds", "1", "--questions", "2"),
)
CALLERS = {"one": 1, "four": 4, "sixteen": 16}
KEYS = {name: f"{name}-key" for name in [*CALLERS, "flood", "interactive", "watch"]}
STREAM_TOKENS = 64
FLOOD_STREAMS = 30
BACKLOGGED = 0.25
"""A caller is backlogged when requests of it wait (queued or preempted) in at least this share of samples."""


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=20.0, help="each round's measured window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before a window, the streams filling the slots")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of three callers, fair and fifo taking turns")
    parser.add_argument("--questions", type=int, default=20, help="interactive questions beside the flood")


def bearer(name: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {KEYS[name]}"),)


def jain(rates: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    return sum(rates) ** 2 / (len(rates) * sum(r * r for r in rates)) if rates and any(rates) else 0.0


class ClosedLoop:
    """`streams` workers of one caller, each starting a new greedy stream as its last ends; records
    (time, tokens) per message and the refusals."""

    def __init__(self, stub, caller: str, streams: int, tokens: int, stop: threading.Event) -> None:
        self.received: list[tuple[float, int]] = []
        self.refused = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(stub, caller, tokens, stop, PROMPTS[i % len(PROMPTS)]),
                                          daemon=True) for i in range(streams)]
        for thread in self._threads:
            thread.start()

    def _work(self, stub, caller: str, tokens: int, stop: threading.Event, prompt: str) -> None:
        while not stop.is_set():
            try:
                previous = 0
                for message in stub.GenerateStream(greedy_request(prompt, tokens), metadata=bearer(caller), timeout=600):
                    with self._lock:
                        self.received.append((time.monotonic(), message.generated_tokens - previous))
                    previous = message.generated_tokens
                    if stop.is_set():
                        break
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    self.refused += 1
                    time.sleep(0.2)
                elif not stop.is_set():
                    raise

    def tokens_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(n for at, n in self.received if start <= at < end)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=120)


def status(stub) -> pb.GetServerStatusResponse:
    return stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=bearer("watch"), timeout=10)


def served(s: pb.GetServerStatusResponse) -> int:
    return sum(c.prompt_tokens_total + c.generated_tokens_total for c in s.callers)


def three_callers(stub, seconds: float, warmup: float) -> dict:
    """One round: each caller's tokens/s in the window, who was backlogged, preemptions and recomputed tokens."""
    stop = threading.Event()
    loops = {name: ClosedLoop(stub, name, streams, STREAM_TOKENS, stop) for name, streams in CALLERS.items()}
    time.sleep(warmup)
    before = status(stub)
    start, samples = time.monotonic(), []
    while time.monotonic() < start + seconds:
        samples.append({c.caller: c.queued_requests + c.preempted_sequences for c in status(stub).callers})
        time.sleep(0.25)
    end = time.monotonic()
    after = status(stub)
    stop.set()
    for loop in loops.values():
        loop.join()
    rates = {name: loop.tokens_between(start, end) / (end - start) for name, loop in loops.items()}
    backlogged = [name for name in CALLERS if sum(s.get(name, 0) > 0 for s in samples) / len(samples) >= BACKLOGGED]
    return {"rates": rates, "jain": jain([rates[name] for name in backlogged]), "aggregate": sum(rates.values()),
            "recomputed": after.recomputed_tokens_total - before.recomputed_tokens_total,
            "served": served(after) - served(before), "preempted": after.preempted_total - before.preempted_total}


def first_tokens(stub, questions: int) -> tuple[list[float], int]:
    """Seconds to the first token of each short question, one after another; and how many were refused."""
    times, refused = [], 0
    for i in range(questions):
        start = time.perf_counter()
        try:
            call = stub.GenerateStream(greedy_request(PROMPTS[i % len(PROMPTS)], 8), metadata=bearer("interactive"),
                                       timeout=600)
            next(call)
            times.append(time.perf_counter() - start)
            list(call)
        except grpc.RpcError as error:
            if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused += 1
        time.sleep(0.3)
    return times, refused


def beside_flood(stub, questions: int, warmup: float) -> dict:
    """The interactive caller's median first token idle (half before the flood, half after) and beside it."""
    idle, _ = first_tokens(stub, max(questions // 2, 1))
    stop = threading.Event()
    flood = ClosedLoop(stub, "flood", FLOOD_STREAMS, 256, stop)
    time.sleep(warmup)  # the flood fills every slot and the queue
    busy, refused = first_tokens(stub, questions)
    stop.set()
    flood.join()
    idle += first_tokens(stub, max(questions - questions // 2, 1))[0]
    return {"idle": statistics.median(idle), "flood": statistics.median(busy) if busy else None, "refused": refused}


def measure(run: Run, args: argparse.Namespace) -> None:
    keys = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())
    with Sides() as sides:
        # Both stay up (an idle server waits on its queue, using no CPU) and take turns: noise falls on both.
        stubs = {scheduling: sides.tokenspout("--scheduling", scheduling, "--api-keys", keys, "--max-batch-size", "8",
                                              "--context-length", "512", "--log-level", "warning").stub
                 for scheduling in ("fair", "fifo")}
        rounds: dict[str, list[dict]] = {scheduling: [] for scheduling in stubs}
        for turn in range(args.rounds):
            for scheduling in rotated(list(stubs), turn):
                rounds[scheduling].append(three_callers(stubs[scheduling], args.seconds, args.warmup))
        interactive = {scheduling: beside_flood(stubs[scheduling], args.questions, args.warmup) for scheduling in stubs}
    rows, summary = [], {}
    for scheduling, done in rounds.items():
        t = interactive[scheduling]
        summary[scheduling] = {
            "jain": statistics.median(r["jain"] for r in done),
            "aggregate": statistics.median(r["aggregate"] for r in done),
            "recomputed": sum(r["recomputed"] for r in done) / max(sum(r["served"] for r in done), 1),
        }
        flood = f"{t['flood'] * 1000:.0f}" if t["flood"] is not None else f"all {t['refused']} refused"
        rows.append([scheduling, round(summary[scheduling]["jain"], 3),
                     " / ".join(f"{statistics.median(r['rates'][name] for r in done):.1f}" for name in CALLERS),
                     round(summary[scheduling]["aggregate"], 1), sum(r["preempted"] for r in done),
                     f"{100 * summary[scheduling]['recomputed']:.1f}%", f"{t['idle'] * 1000:.0f} / {flood}"])
    run.table("", ["scheduling", "Jain's index", "tokens/s, callers of 1 / 4 / 16 streams", "aggregate tokens/s",
                   "preemptions", "recomputed / served", "interactive first token, idle / beside the flood, ms"], rows)
    fair, fifo, t = summary["fair"], summary["fifo"], interactive["fair"]
    run.target("Jain's index among backlogged callers, fair", fair["jain"], ">=", 0.95)
    run.target("aggregate tokens/s, fair / fifo", fair["aggregate"] / fifo["aggregate"], ">=", 0.95)
    run.target("tokens recomputed after preemption / served, fair", fair["recomputed"], "<=", 0.10)
    every_question_refused = 1e6  # a finite miss: JSON has no infinity
    run.target("interactive first token beside the flood / idle, fair",
               t["flood"] / t["idle"] if t["flood"] is not None else every_question_refused, "<=", 3.0)
