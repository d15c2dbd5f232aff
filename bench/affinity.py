"""Prefix-affinity routing (issue 23): chat sessions through Envoy and HAProxy in front of three
replicas, with the affinity key (x-tokenspout-affinity) and without, every figure from one run.

Prints, for one replica alone called directly (with the replicas' own flags, and with cache room
for every session, 8 + 8 cache streams: the baseline) and for each proxy with and without the key: the share of prompt
tokens served from cache (usage.cached_tokens / prompt_tokens) and
its ratio to the baseline's (target >= 0.9 with the key), the caller's TTFT median and its ratio
to the keyless run's through the same proxy, and the load spread (the busiest replica's turns over
the mean; target <= 1.5).

Each replica runs llama.cpp on one thread with --max-batch-size 8 (tests/harness/proxies.py), so it keeps
at most 10 prefixes (8 + prefix_cache_slots 2). On a 2-core machine the three replicas share the
cores; the TTFTs are that machine's.

    python -m bench.affinity [--sessions 12] [--turns 6] [--tokens 4] [--reps 1]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

from tests.harness.chat_sessions import run_sessions
from tests.harness.proxies import REPLICA_FLAGS, Envoy, HAProxy, start_replicas, stop_replicas
from tests.harness.servers import start_server

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=4, help="max_new_tokens per turn")
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    print(f"{args.sessions} sessions x {args.turns} turns, {args.tokens} tokens per answer, 3 replicas, "
          f"{os.cpu_count()} cores, {args.reps} rep(s)")
    with tempfile.TemporaryDirectory() as tmp:
        replicas = start_replicas(pathlib.Path(tmp), 3)
        roomy = start_server(pathlib.Path(tmp), *REPLICA_FLAGS, "--prefix-cache-slots", "8")
        proxies = {}
        try:
            addresses = [r.address for r in replicas]
            proxies = {"Envoy": Envoy(pathlib.Path(tmp), addresses), "HAProxy": HAProxy(pathlib.Path(tmp), addresses)}
            for rep in range(args.reps):
                def run(address, label, logs, affinity=True, rep=rep):  # called within this rep
                    return run_sessions(address, f"{label}-{rep}", logs, args.sessions, args.turns, args.tokens, affinity)

                same = run(replicas[0].address, "alone-10-cache-streams", replicas[:1])
                alone = run(roomy.address, "alone-16-cache-streams-baseline", [roomy])
                print(same.summary(1))
                print(alone.summary(1))
                base = alone.cache_share()
                for name, proxy in proxies.items():
                    keyed = run(proxy.address, f"{name}-key", replicas)
                    keyless = run(proxy.address, f"{name}-nokey", replicas, affinity=False)
                    for result in (keyed, keyless):
                        print(f"  {result.summary(3)}; cache share / one replica alone {result.cache_share() / base:.3f}")
                    print(f"  {name}: TTFT median with the key / without {keyed.ttft_median_ms() / keyless.ttft_median_ms():.3f}")
        finally:
            for proxy in proxies.values():
                proxy.stop()
            stop_replicas([*replicas, roomy])
    return 0


if __name__ == "__main__":
    sys.exit(main())
