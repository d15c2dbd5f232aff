"""Publishing KV-cache events, and an index rebuilt from them.
Tokens/s with events on (a subscriber draining them) and off, alternated. Then random requests with evictions: a gRPC
watcher from the start and a ZMQ subscriber joining after a third must rebuild the server's index from events alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import threading
import time

from bench.harness.pairing import alternate, span
from bench.harness.prompt_kinds import clauses
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from tests.harness.kv_subscriber import GrpcFollower, ZmqFollower, random_request
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(area="KV-cache events", smoke=("--reps", "1", "--requests", "10", "--streams", "2", "--tokens", "8"),
                      order=1)

SETTINGS = ("--context-length", "1024", "--max-batch-size", "8", "--prefix-cache-slots", "2")
EVENTS = ("--cache-events", "--cache-events-endpoint", "tcp://127.0.0.1:*", "--cache-events-replay-endpoint",
          "tcp://127.0.0.1:*")
def decode_rate(stub, rep: int, streams: int, tokens: int) -> float:
    """Tokens/s of `streams` concurrent greedy streams whose prompts share a ~300-token prefix (fresh per rep)."""
    shared = clauses(rep)
    requests = [pb.GenerateStreamRequest(
        prompt=f"{shared}\nQuestion {i}: what does clause {i} say?",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    ) for i in range(streams)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        finals = list(pool.map(lambda r: list(stub.GenerateStream(r, timeout=600))[-1], requests))
    assert all(f.generated_tokens == tokens for f in finals)
    return streams * tokens / (time.perf_counter() - start)


def drain(follower: ZmqFollower, stop: threading.Event) -> None:
    while not stop.is_set():
        follower.poll(0.2)



def wait_for(condition, what, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what()}")
        time.sleep(0.05)


def idle_sequence(stub) -> int:
    while True:
        first = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        time.sleep(0.3)
        second = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        if not second.running_sequences and not second.queued_requests and \
                first.cache_events_sequence == second.cache_events_sequence:
            return second.cache_events_sequence


def rebuild(run: Run, rows: list, stub, requests: int) -> None:
    """`requests` random requests, 4 at a time; then both followers' indexes against the server's snapshot."""
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    sources = info.cache_event_sources
    rng = random.Random(2026)
    stems = [[rng.randrange(300, 4000) for _ in range(200)] for _ in range(6)]
    watcher = GrpcFollower(stub, pb.WatchCacheEventsRequest(start_sequence=idle_sequence(stub) + 1))
    late: ZmqFollower | None = None
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pending = []
        for i in range(requests):
            if i == requests // 3:
                late = ZmqFollower(sources.endpoint, sources.replay_endpoint, sources.topic)
            request = random_request(rng, stems, info.special_tokens.bos_token_id, 40, 4)
            pending.append(pool.submit(lambda r: list(stub.GenerateStream(r, timeout=600)), request))
            if len(pending) >= 8:
                pending.pop(0).result()
            if late is not None:
                late.poll(0.0)
        for future in pending:
            future.result()
    last = idle_sequence(stub)
    assert late is not None
    wait_for(lambda: late.poll(0.2) is not None and late.next_sequence == last + 1,
             what=lambda: f"the ZMQ subscriber at {late.next_sequence}, the server at {last}")
    wait_for(lambda: watcher.sequences and watcher.sequences[-1] == last,
             what=lambda: f"the gRPC watcher at {watcher.sequences[-1:]}, error {watcher.error}, the server at {last}")
    watcher.close()
    own = GrpcFollower(stub, pb.WatchCacheEventsRequest(snapshot=True))
    wait_for(lambda: own.sequences, what=lambda: "a snapshot")
    own.close()
    late.close()
    first = watcher.sequences[0]
    followers = {  # gapless, index equal to the server's
        "gRPC watcher from the start": (watcher.sequences == list(range(first, last + 1)),
                                        watcher.index.blocks == own.index.blocks),
        f"ZMQ subscriber joining after a third ({late.snapshots} snapshot, {late.replays} replay)": (
            late.sequences == list(range(late.sequences[0], last + 1)), late.index.blocks == own.index.blocks),
    }
    rows.append([f"after {requests:,} random requests (batches {first:,}..{last:,}, {watcher.index.removed:,} blocks removed): "
                 f"{' / '.join(followers)}, gapless and index equal to the server's",
                 " / ".join(f"{yes(gapless)}, {yes(equal)}" for gapless, equal in followers.values())])
    run.target("followers whose index, rebuilt from the events alone, equals the server's", sum(
        gapless and equal for gapless, equal in followers.values()), ">=", len(followers))


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=6, help="0: no publishing cost")
    parser.add_argument("--requests", type=int, default=1000, help="0: no rebuild")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams of the publishing cost")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream of the publishing cost")


def publishing_cost(run: Run, rows: list, stubs: dict, args: argparse.Namespace) -> None:
    sources = stubs["on"].GetModelInfo(pb.GetModelInfoRequest(), timeout=10).cache_event_sources
    subscriber, stop = ZmqFollower(sources.endpoint, sources.replay_endpoint), threading.Event()
    draining = threading.Thread(target=drain, args=(subscriber, stop), daemon=True)
    draining.start()
    try:
        for stub in stubs.values():
            decode_rate(stub, -1, args.streams, args.tokens)  # warm-up
        rates = alternate({side: (lambda rep, stub=stub: decode_rate(stub, rep, args.streams, args.tokens))
                           for side, stub in stubs.items()}, range(args.reps))
    finally:
        stop.set()
        draining.join()
        subscriber.close()
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    rows.append([f"decode tokens/s of {args.streams} streams x {args.tokens} tokens, events on / off: per rep (median)",
                 f"{span(ratios, 3)} ({statistics.median(ratios):.3f})"])
    run.target("decode tokens/s, events on / off, median of reps", statistics.median(ratios), ">=", 0.98)


def measure(run: Run, args: argparse.Namespace) -> None:
    rows: list[list] = []
    if args.reps:
        with Sides() as sides:
            publishing_cost(run, rows, {"off": sides.tokenspout(*SETTINGS).stub, "on": sides.tokenspout(*SETTINGS, *EVENTS).stub},
                            args)
    if args.requests:  # on a server of its own, whose events start with these requests
        with Sides() as sides:
            rebuild(run, rows, sides.tokenspout(*SETTINGS, *EVENTS).stub, args.requests)
    run.table("", ["measure", "result"], rows)
