"""Fair sharing against first come, first served, both measured in this run on the embedded model.

Two servers, the same settings but `scheduling` (fair and fifo), both up at once and loaded in turns
(so the machine's noise falls on both alike), each given:

  1. --rounds times: three callers (API keys) keeping 1, 4 and 16 greedy streams open, a new one as
     each ends, for --seconds. Per caller: tokens/s received in the measured window (after a
     warm-up), and whether it was backlogged (requests of it queued or preempted in a quarter of
     GetServerStatus samples or more: it asks for more than its share). Prints Jain's fairness
     index of tokens/s among the backlogged callers (target >= 0.95 under fair), the aggregate
     tokens/s (fair / fifo, target >= 0.95), and the tokens recomputed after preemption against
     the tokens served (target <= 10%); medians over the rounds.
  2. An interactive caller's time to first token, the median of --questions short requests sent one
     after another: on the idle server (half before the flood, half after), and beside a 30-stream
     flood from another caller (target: <= 3x idle under fair); refusals counted.

    python -m bench.fairness [--seconds 20] [--rounds 3] [--questions 20]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import statistics
import tempfile
import threading
import time

import grpc

from bench.common import PROMPTS, greedy_request
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

CALLERS = {"one": 1, "four": 4, "sixteen": 16}
KEYS = {name: f"{name}-key" for name in [*CALLERS, "flood", "interactive", "watch"]}
STREAM_TOKENS = 64
FLOOD_STREAMS = 30
BACKLOGGED = 0.25
"""A caller is backlogged when requests of it wait (queued or preempted) in at least this share of samples."""


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
        self._threads = [
            threading.Thread(target=self._work, args=(stub, caller, tokens, stop, PROMPTS[i % len(PROMPTS)]),
                             daemon=True)
            for i in range(streams)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, stub, caller: str, tokens: int, stop: threading.Event, prompt: str) -> None:
        while not stop.is_set():
            try:
                previous = 0
                call = stub.GenerateStream(greedy_request(prompt, tokens), metadata=bearer(caller), timeout=600)
                for message in call:
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


def three_callers(stub, seconds: float) -> dict:
    stop = threading.Event()
    loops = {name: ClosedLoop(stub, name, streams, STREAM_TOKENS, stop) for name, streams in CALLERS.items()}
    time.sleep(5.0)  # warm-up: every caller's streams running or queued
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
    waited = {name: sum(s.get(name, 0) > 0 for s in samples) / len(samples) for name in CALLERS}
    backlogged = [name for name in CALLERS if waited[name] >= BACKLOGGED]

    def served(s: pb.GetServerStatusResponse) -> int:
        return sum(c.prompt_tokens_total + c.generated_tokens_total for c in s.callers)

    return {
        "rates": rates,
        "waited": waited,
        "backlogged": backlogged,
        "jain": jain([rates[name] for name in backlogged]),
        "aggregate": sum(rates.values()),
        "recomputed": after.recomputed_tokens_total - before.recomputed_tokens_total,
        "served": served(after) - served(before),
        "preempted": after.preempted_total - before.preempted_total,
    }


def ttft(stub, questions: int) -> tuple[list[float], int]:
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


def interactive_beside_flood(stub, questions: int) -> dict:
    idle, _ = ttft(stub, questions // 2)
    stop = threading.Event()
    flood = ClosedLoop(stub, "flood", FLOOD_STREAMS, 256, stop)
    time.sleep(5)  # the flood fills every slot and the queue
    busy, refused = ttft(stub, questions)
    stop.set()
    flood.join()
    idle += ttft(stub, questions - questions // 2)[0]  # idle again: the machine's noise falls on both sides
    return {"idle": statistics.median(idle), "flood": statistics.median(busy) if busy else float("inf"),
            "refused": refused, "flood_refused": flood.refused}


def start(scheduling: str):
    keys = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())
    return start_server(pathlib.Path(tempfile.mkdtemp()), "--scheduling", scheduling, "--api-keys", keys,
                        "--max-batch-size", "8", "--context-length", "512", "--log-level", "warning")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="each round's measured window")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of part 1, fair and fifo taking turns")
    parser.add_argument("--questions", type=int, default=20)
    args = parser.parse_args()
    print(f"load average before: {load()} ({os.cpu_count()} cores)")
    # Both servers stay up (an idle one waits on its queue, using no CPU) and take turns, so the
    # machine's noise falls on both alike.
    servers = {scheduling: start(scheduling) for scheduling in ("fair", "fifo")}
    channels = {scheduling: grpc.insecure_channel(server.address) for scheduling, server in servers.items()}
    stubs = {scheduling: pb_grpc.GenerationServiceStub(channel) for scheduling, channel in channels.items()}
    try:
        rounds = {scheduling: [] for scheduling in servers}
        for _ in range(args.rounds):
            for scheduling, stub in stubs.items():
                rounds[scheduling].append(three_callers(stub, args.seconds))
        ttfts = {scheduling: interactive_beside_flood(stub, args.questions) for scheduling, stub in stubs.items()}
    finally:
        for channel in channels.values():
            channel.close()
        for server in servers.values():
            stop_server(server)
    print(f"load average after: {load()}")
    summary = {}
    for scheduling in servers:
        for n, r in enumerate(rounds[scheduling], 1):
            rates = ", ".join(f"{name} ({CALLERS[name]}) {rate:.1f}" for name, rate in r["rates"].items())
            waited = ", ".join(f"{name} {100 * share:.0f}%" for name, share in r["waited"].items())
            print(f"[{scheduling} {n}] tokens/s per caller (streams): {rates}; aggregate {r['aggregate']:.1f}")
            print(f"[{scheduling} {n}] samples with requests waiting: {waited}; Jain's index among the backlogged "
                  f"({', '.join(r['backlogged']) or 'none'}): {r['jain']:.3f}; {r['preempted']} preemptions "
                  f"recomputed {r['recomputed']} of {r['served']} tokens served")
        t = ttfts[scheduling]
        print(f"[{scheduling}] interactive TTFT median: idle {t['idle'] * 1000:.0f} ms, beside a "
              f"{FLOOD_STREAMS}-stream flood {t['flood'] * 1000:.0f} ms ({t['flood'] / t['idle']:.2f}x); "
              f"{t['refused']} of {args.questions} "
              f"refused; the flood was refused {t['flood_refused']} times")
        summary[scheduling] = {
            "jain": statistics.median(r["jain"] for r in rounds[scheduling]),
            "aggregate": statistics.median(r["aggregate"] for r in rounds[scheduling]),
            "recomputed": sum(r["recomputed"] for r in rounds[scheduling])
            / max(sum(r["served"] for r in rounds[scheduling]), 1),
        }
    fair, fifo, t = summary["fair"], summary["fifo"], ttfts["fair"]
    print(f"\nmedians over {args.rounds} rounds: Jain's index fair {fair['jain']:.3f} (target >= 0.95), fifo "
          f"{fifo['jain']:.3f}; aggregate tokens/s fair {fair['aggregate']:.1f}, fifo {fifo['aggregate']:.1f}: "
          f"{fair['aggregate'] / fifo['aggregate']:.3f} (target >= 0.95); recomputed {100 * fair['recomputed']:.2f}% "
          f"of served (target <= 10%); interactive TTFT beside the flood {t['flood'] / t['idle']:.2f}x idle "
          "(target <= 3)")


if __name__ == "__main__":
    main()
