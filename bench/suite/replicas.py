"""Replicas behind HAProxy.
Replicas of one thread, batch 8, behind deploy/haproxy/haproxy.cfg: 8 streams a replica, direct and proxied in turn.
"""

from __future__ import annotations

import argparse
import statistics

import grpc

from bench.harness.pairing import span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import PROMPTS, aggregate_rate, cpu_seconds
from tests.harness.proxies import HAProxy, start_replicas, stop_replicas
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="Client, authentication, tracing and proxy overhead",
    smoke=("--tokens", "8", "--reps", "1"),
    order=10,
)
BATCH = 8  # REPLICA_FLAGS' --max-batch-size


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)


def rate(address: str, streams: int, tokens: int) -> float:
    with grpc.insecure_channel(address) as channel:
        return aggregate_rate(pb_grpc.GenerationServiceStub(channel), streams, tokens, prompts=(PROMPTS * 4)[:streams])


def measure(run: Run, args: argparse.Namespace) -> None:
    with Sides() as sides:
        replicas = start_replicas(sides.tmp, 3)
        sides.callback(stop_replicas, replicas)
        proxies = []
        for count in (1, 2, 3):
            proxies.append(proxy := HAProxy(sides.tmp, [r.address for r in replicas[:count]]))
            sides.callback(proxy.stop)
        direct_address, proxy_address = replicas[0].address, proxies[0].address
        rate(proxy_address, BATCH, 8)  # warm up
        direct, proxied, ratios = [], [], []
        proxy_cpu, replica_cpu = cpu_seconds(proxies[0].process.pid), cpu_seconds(replicas[0].process.pid)
        for _ in range(args.reps):  # direct, proxy, proxy, direct: a drift in the machine's load hits both alike
            d1, p1 = rate(direct_address, BATCH, args.tokens), rate(proxy_address, BATCH, args.tokens)
            p2, d2 = rate(proxy_address, BATCH, args.tokens), rate(direct_address, BATCH, args.tokens)
            direct += [d1, d2]
            proxied += [p1, p2]
            ratios.append((p1 + p2) / (d1 + d2))
        # CPU time is not disturbed by other load the way wall-clock rates are: what HAProxy spent against what
        # the replica spent over the same rounds (half of them proxied).
        proxy_cpu = cpu_seconds(proxies[0].process.pid) - proxy_cpu
        replica_cpu = (cpu_seconds(replicas[0].process.pid) - replica_cpu) / 2
        scaling = {count: statistics.median(rate(proxy.address, BATCH * count, args.tokens) for _ in range(args.reps))
                   for count, proxy in enumerate(proxies[1:], 2)}
    ratio = statistics.median(ratios)
    run.table("", ["direct, tok/s", "through HAProxy, tok/s", "proxy / direct (rounds)", "HAProxy CPU / replica CPU",
                   "through HAProxy at 2 / 3 replicas, tok/s"],
              [[round(statistics.median(direct), 1), round(statistics.median(proxied), 1), f"{ratio:.3f} ({span(ratios, 3)})",
                round(proxy_cpu / replica_cpu, 4), " / ".join(f"{r:.1f}" for r in scaling.values())]])
    run.target("tokens/s through HAProxy / direct, 1 replica", ratio, ">=", 0.95)
