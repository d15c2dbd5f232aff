"""KV-cache events: what publishing costs, and whether a router rebuilds the cache index exactly.

Two servers on the embedded model with the same settings, one with cache_events on (ZMQ PUB and replay,
a subscriber draining it all along), one without. Prints:

  1. decode tokens/s of 8 concurrent greedy streams sharing a long prefix, events on / events off,
     the servers alternated rep by rep (target: on >= 0.98x off)
  2. N random requests (shared stems, evictions) on the events server, a gRPC watcher from the start
     and a ZMQ subscriber joining late (snapshot over replay, gaps filled by replay): both indexes
     rebuilt from the events alone must equal the server's own snapshot, with gapless sequences

    python -m bench.kv_events [--reps 5] [--requests 1000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import random
import statistics
import tempfile
import threading
import time

import grpc

from tests.harness.kv_subscriber import GrpcFollower, ZmqFollower
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SETTINGS = ("--context-length", "1024", "--max-batch-size", "8", "--prefix-cache-slots", "2")
EVENTS = ("--cache-events", "--cache-events-endpoint", "tcp://127.0.0.1:*", "--cache-events-replay-endpoint",
          "tcp://127.0.0.1:*")
STREAMS, TOKENS = 8, 64


def decode_rate(stub, rep: int) -> float:
    """Tokens/s of STREAMS concurrent greedy streams whose prompts share a ~300-token prefix (fresh per rep)."""
    shared = " ".join(f"Clause {i} of contract {rep}: the tenant keeps the garden tidy." for i in range(25))
    requests = [pb.GenerateStreamRequest(
        prompt=f"{shared}\nQuestion {i}: what does clause {i} say?",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=TOKENS, ignore_eos=True),
    ) for i in range(STREAMS)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        finals = list(pool.map(lambda r: list(stub.GenerateStream(r, timeout=600))[-1], requests))
    assert all(f.generated_tokens == TOKENS for f in finals)
    return STREAMS * TOKENS / (time.perf_counter() - start)


def drain(follower: ZmqFollower, stop: threading.Event) -> None:
    while not stop.is_set():
        follower.poll(0.2)


def random_request(rng: random.Random, stems: list[list[int]], bos: int) -> pb.GenerateStreamRequest:
    """A prompt of a random length of one of a few stems and a few tokens of its own: many share blocks."""
    stem = rng.choice(stems)
    tokens = [bos, *stem[: rng.randrange(len(stem) + 1)], *(rng.randrange(300, 4000) for _ in range(rng.randrange(4, 40)))]
    return pb.GenerateStreamRequest(
        prompt_token_ids=pb.TokenIds(ids=tokens), sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=rng.randrange(1, 4), ignore_eos=True),
    )


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


def rebuild(stub, requests: int) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    sources = info.cache_event_sources
    rng = random.Random(2026)
    stems = [[rng.randrange(300, 4000) for _ in range(200)] for _ in range(6)]
    watcher = GrpcFollower(stub, pb.WatchCacheEventsRequest(start_sequence=idle_sequence(stub) + 1))
    late: ZmqFollower | None = None
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pending = []
        for i in range(requests):
            if i == requests // 3:
                late = ZmqFollower(sources.endpoint, sources.replay_endpoint, sources.topic)
            request = random_request(rng, stems, info.special_tokens.bos_token_id)
            pending.append(pool.submit(lambda r: list(stub.GenerateStream(r, timeout=600)), request))
            if len(pending) >= 8:
                pending.pop(0).result()
            if late is not None:
                late.poll(0.0)
        for future in pending:
            future.result()
    seconds = time.perf_counter() - start
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
    first = watcher.sequences[0]
    print(f"  {requests} requests in {seconds:.0f} s; batches {first}..{last}; server holds {len(own.index.blocks)} blocks; "
          f"the watcher saw {watcher.index.removed} blocks removed")
    print(f"  gRPC watcher: gapless {watcher.sequences == list(range(first, last + 1))}, "
          f"index equal {watcher.index.blocks == own.index.blocks}")
    print(f"  late ZMQ subscriber: snapshots {late.snapshots}, replays {late.replays}, gapless after its snapshot "
          f"{late.sequences == list(range(late.sequences[0], last + 1))}, index equal {late.index.blocks == own.index.blocks}")
    late.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="0: skip part 1")
    parser.add_argument("--requests", type=int, default=1000, help="0: skip part 2")
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-kv-events-"))
    if not args.reps:
        on = start_server(tmp, *SETTINGS, *EVENTS)
        try:
            with grpc.insecure_channel(on.address) as channel:
                print(f"2. rebuild from events after {args.requests} random requests with evictions:", flush=True)
                rebuild(pb_grpc.GenerationServiceStub(channel), args.requests)
        finally:
            stop_server(on)
        return
    off = start_server(tmp, *SETTINGS)
    on = start_server(tmp, *SETTINGS, *EVENTS)
    try:
        with grpc.insecure_channel(off.address) as off_channel, grpc.insecure_channel(on.address) as on_channel:
            stubs = {"off": pb_grpc.GenerationServiceStub(off_channel), "on": pb_grpc.GenerationServiceStub(on_channel)}
            sources = stubs["on"].GetModelInfo(pb.GetModelInfoRequest(), timeout=10).cache_event_sources
            subscriber, stop = ZmqFollower(sources.endpoint, sources.replay_endpoint), threading.Event()
            draining = threading.Thread(target=drain, args=(subscriber, stop), daemon=True)
            draining.start()
            for stub in stubs.values():
                decode_rate(stub, -1)  # warm-up
            ratios, rates = [], {"on": [], "off": []}
            for rep in range(args.reps):
                order = ("off", "on") if rep % 2 == 0 else ("on", "off")
                got = {side: decode_rate(stubs[side], rep) for side in order}
                for side, rate in got.items():
                    rates[side].append(rate)
                ratios.append(got["on"] / got["off"])
            stop.set()
            draining.join()
            print(f"1. decode tokens/s, {STREAMS} streams x {TOKENS} tokens, {args.reps} reps alternated:")
            for side in ("off", "on"):
                print(f"  events {side}: {min(rates[side]):.1f}-{max(rates[side]):.1f} tok/s "
                      f"(median {statistics.median(rates[side]):.1f})")
            print(f"  on/off per rep: {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f} "
                  f"(target >= 0.98); the subscriber applied {len(subscriber.sequences)} batches, "
                  f"{subscriber.snapshots} snapshot(s)")
            subscriber.close()
            if args.requests:
                print(f"2. rebuild from events after {args.requests} random requests with evictions:", flush=True)
                rebuild(stubs["on"], args.requests)
    finally:
        for server in (off, on):
            stop_server(server)


if __name__ == "__main__":
    main()
