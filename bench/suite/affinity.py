"""Prefix-affinity routing.
12 chat sessions of 6 turns through Envoy and HAProxy (`deploy/`) to three replicas (1 thread, 10 cache streams each),
with the affinity key and without, against one replica with room for all (16 cache streams, the baseline) and its 10.
"""

from __future__ import annotations

import argparse
import re
import statistics

from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from tests.harness.chat_sessions import run_sessions
from tests.harness.proxies import REPLICA_FLAGS, Envoy, HAProxy, start_replicas, stop_replicas
from tests.harness.servers import start_server, stop_server

BENCHMARK = Benchmark(
    area="Prefix cache and affinity",
    smoke=("--sessions", "3", "--turns", "2", "--tokens", "2", "--proxies", "HAProxy"),
    order=3,
)
PROXIES = {"Envoy": Envoy, "HAProxy": HAProxy}
BASELINE, ALONE = "one replica, 16 cache streams (baseline)", "one replica, its 10 cache streams"


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=4, help="max_new_tokens per turn")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--proxies", default="Envoy,HAProxy", help="comma-separated, of " + ", ".join(PROXIES))


def measure(run: Run, args: argparse.Namespace) -> None:
    runs: dict[str, list] = {}
    with Sides() as sides:
        replicas = start_replicas(sides.tmp, 3)
        sides.callback(stop_replicas, replicas)
        roomy = start_server(sides.tmp, *REPLICA_FLAGS, "--prefix-cache-slots", "8")
        sides.callback(stop_server, roomy)
        addresses = [r.address for r in replicas]
        proxies = {}
        for name in args.proxies.split(","):
            proxies[name] = proxy = PROXIES[name](sides.tmp, addresses)
            sides.callback(proxy.stop)
        for rep in range(args.reps):
            def sessions(label, address, logs, affinity=True, rep=rep):
                slug = re.sub(r"\W+", "-", label).strip("-")  # request ids are read back from the replicas' logs
                runs.setdefault(label, []).append(run_sessions(address, f"{slug}-{rep}", logs, args.sessions,
                                                               args.turns, args.tokens, affinity))

            sessions(BASELINE, roomy.address, [roomy])
            sessions(ALONE, replicas[0].address, replicas[:1])
            for name, proxy in proxies.items():
                sessions(f"{name}, with the key", proxy.address, replicas)
                sessions(f"{name}, without", proxy.address, replicas, affinity=False)
    base = statistics.median(r.cache_share() for r in runs[BASELINE])
    rows, shares, spreads = [], [], []

    def figures(label: str, count: int) -> tuple[float, float, float, str, float, int]:
        done = runs[label]
        share, spread = statistics.median(r.cache_share() for r in done), statistics.median(r.spread(count) for r in done)
        return (share, share / base, statistics.median(r.ttft_median_ms() for r in done),
                "-".join(str(n) for n in done[-1].served(count)), spread, sum(len(r.failed()) for r in done))

    for pair, count in [((BASELINE, ALONE), 1), *(((f"{name}, with the key", f"{name}, without"), 3) for name in proxies)]:
        a, b = (figures(label, count) for label in pair)
        rows.append([f"{pair[0]} / {pair[1].split(', ')[-1]}", f"{a[0]:.3f} / {b[0]:.3f}", f"{a[1]:.3f} / {b[1]:.3f}",
                     f"{a[2]:,.0f} / {b[2]:,.0f}", f"{a[3]} / {b[3]}", f"{a[4]:.2f} / {b[4]:.2f}" if count > 1 else None,
                     a[5] + b[5]])
        if count > 1:
            shares.append(a[1])
            spreads.append(a[4])
    run.table("", ["side", "cache share", "/ baseline", "TTFT median, ms", "turns per replica", "busiest / mean", "failed"],
              rows)
    run.target("cache share with the key / the baseline's, the lower of the proxies", min(shares), ">=", 0.9)
    run.target("busiest replica's turns / the mean with the key, the higher of the proxies", max(spreads), "<=", 1.5)
