"""Replicas behind HAProxy (deploy/haproxy/haproxy.cfg), every figure from one run.

Prints:
  1. at 1 replica: aggregate tokens/s of the same concurrent streams called directly and
     through the proxy, in direct-proxy-proxy-direct rounds, and proxy / direct (target >= 0.95)
     and, steadier on a busy machine, HAProxy's CPU time against the replica's for the same streams
  2. aggregate tokens/s through the proxy at 1, 2 and 3 replicas, each replica given a full
     batch of concurrent streams

Each replica runs llama.cpp on one thread. On a 2-core machine the second replica has a core
of its own and the third shares one, so item 2 shows the proxy and oversubscription, not the
scaling a node per replica would show.

    python -m bench.replicas [--tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile

import grpc

from bench.common import PROMPTS, aggregate_rate, cpu_seconds
from tests.harness.proxies import HAProxy, start_replicas, stop_replicas
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

BATCH = 8  # REPLICA_FLAGS' --max-batch-size



def rate(address: str, streams: int, tokens: int) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return aggregate_rate(stub, streams, tokens, prompts=(PROMPTS * 4)[:streams])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.tokens} tokens per stream, {BATCH} streams per replica, {args.reps} reps, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        replicas = start_replicas(pathlib.Path(tmp), 3)
        proxies = []
        try:
            for count in (1, 2, 3):
                proxies.append(HAProxy(pathlib.Path(tmp), [r.address for r in replicas[:count]]))
            rate(proxies[0].address, BATCH, 8)  # warm up
            direct, proxied, ratios = [], [], []
            proxy_cpu, replica_cpu = cpu_seconds(proxies[0].process.pid), cpu_seconds(replicas[0].process.pid)
            for _ in range(args.reps):
                # direct, proxy, proxy, direct: a drift in the machine's load hits both alike
                d1, p1 = rate(replicas[0].address, BATCH, args.tokens), rate(proxies[0].address, BATCH, args.tokens)
                p2, d2 = rate(proxies[0].address, BATCH, args.tokens), rate(replicas[0].address, BATCH, args.tokens)
                direct += [d1, d2]
                proxied += [p1, p2]
                ratios.append((p1 + p2) / (d1 + d2))
            d, p = statistics.median(direct), statistics.median(proxied)
            print(f"1 replica, {BATCH} streams: direct {d:.1f} tok/s, through HAProxy {p:.1f} tok/s (medians)")
            print(f"  proxy / direct, median of {args.reps} direct-proxy-proxy-direct rounds: "
                  f"{statistics.median(ratios):.3f} (target >= 0.95); rounds: {' '.join(f'{r:.3f}' for r in ratios)}")
            # CPU time is not disturbed by other load the way wall-clock rates are: what HAProxy
            # spent against what the replica spent over the same rounds (half of them proxied).
            proxy_cpu = cpu_seconds(proxies[0].process.pid) - proxy_cpu
            replica_cpu = (cpu_seconds(replicas[0].process.pid) - replica_cpu) / 2
            print(f"  HAProxy CPU time / replica CPU time for the proxied streams: {proxy_cpu / replica_cpu:.4f} "
                  f"({proxy_cpu:.2f} s / {replica_cpu:.1f} s)")
            print("aggregate tokens/s through HAProxy by replicas:")
            for count, proxy in enumerate(proxies, 1):
                runs = [rate(proxy.address, BATCH * count, args.tokens) for _ in range(args.reps)]
                print(f"  {count} replica{'s' if count > 1 else ''}, {BATCH * count} streams: {statistics.median(runs):.1f}")
        finally:
            for proxy in proxies:
                proxy.stop()
            stop_replicas(replicas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
