"""This checkout against an older one (`--old DIR`, e.g. a `git worktree` of the previous release),
every figure from one run, the two servers alternating rep by rep so machine noise hits both alike.

  decode     tokens/s of 1 stream and of 8 concurrent streams (bench/common.py), greedy
  ttft       time to first token of 8 short questions, one after another, median
  prefix     bench/prefix.py's workloads: a shared ~1,380-token system prompt (TTFT of requests 2-6,
             one after another and all at once) and an 8-turn chat (prompt tokens computed / sent)

  cpu        the server process's CPU time per generated token over the decode runs (every thread:
             llama.cpp's, the engine's, the event loop's), a reading the host's other tenants move
             less than wall-clock rates

Prints each figure for both (medians) and new/old, the median of each repetition's ratio: the two
servers run back to back within a repetition, so a slow spell of the shared machine hits both. Both
servers run with the same flags; speculation off on the new one unless --speculation says otherwise
(an old server knows no such setting).

    python -m bench.versions --old DIR [--reps 6] [--threads 2] [--speculation off]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

import grpc

from bench.common import aggregate_rate, cpu_seconds, timed_stream
from bench.prefix import chat, multi_turn, ours, shared_prompt_ttft
from bench.threads import first_token_s
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent



def figures(stub, pid: int, rep: int, tokens: int) -> dict[str, float]:
    cpu_before = cpu_seconds(pid)
    single = timed_stream(stub, "The history of the printing press", tokens)[1]
    eight = aggregate_rate(stub, 8, tokens)
    cpu_per_token = (cpu_seconds(pid) - cpu_before) / (9 * tokens)
    ttft = statistics.median(first_token_s(stub, f"Question {rep}.{i}: why is the sky blue?") for i in range(8))
    one_by_one = statistics.median(shared_prompt_ttft(stub, None, rep, at_once=False)[0])
    at_once = statistics.median(shared_prompt_ttft(stub, None, rep, at_once=True)[0])
    sent, computed, _, _ = multi_turn(stub, None, rep)
    return {"decode 1 stream tok/s": single, "decode 8 streams tok/s": eight,
            "server CPU ms per token (lower is better)": cpu_per_token * 1000, "TTFT ms": ttft * 1000,
            "shared prompt TTFT, one after another, ms": one_by_one * 1000,
            "shared prompt TTFT, all at once, ms": at_once * 1000, "8-turn chat computed / sent": computed / sent}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=pathlib.Path, help="the older checkout")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--speculation", default="off", help="the new server's speculation setting")
    args = parser.parse_args()
    flags = ("--context-length", "2048", "--max-batch-size", "8", "--threads", str(args.threads))
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    servers = {"old": start_server(tmp, *flags, root=args.old.resolve()),
               "new": start_server(tmp, *flags, "--speculation", args.speculation)}
    print(f"{os.cpu_count()} cores, {args.threads} threads, old {args.old}, new {ROOT} (speculation {args.speculation})")
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    try:
        channels = {name: grpc.insecure_channel(server.address) for name, server in servers.items()}
        stubs = {name: pb_grpc.GenerationServiceStub(channel) for name, channel in channels.items()}
        for stub in stubs.values():
            ours(stub, chat("Warm up.", [], "Hi"), 4)
        for rep in range(args.reps):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                results[name].append(figures(stubs[name], servers[name].process.pid, rep, args.tokens))
    finally:
        for server in servers.values():
            stop_server(server)
    for measure in results["old"][0]:
        old, new = (statistics.median(r[measure] for r in results[name]) for name in ("old", "new"))
        ratio = statistics.median(n[measure] / o[measure] for o, n in zip(results["old"], results["new"]))
        print(f"{measure:<44} old {old:9.2f}  new {new:9.2f}  new/old {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
