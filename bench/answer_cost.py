"""What keeping chats' answers in the prefix cache costs chats that never continue.

Two servers with prefix_cache_exact (where answers are computed again as prompt rows to be shared; to
the token, the default, they are kept as decoded at no cost), prefix_cache_generated on (the default)
and off, each running the same batches of single-turn chats (unique questions, greedy, a fixed number
of tokens, 8 at a time), alternated rep by rep. No answer is ever asked for again, so every answer the
engine computes again as prompt rows (backend.llamacpp.retile) is pure cost. Between sides the
benchmark waits until the server is done computing answers again while idle, so one side's leftovers
never slow the other's run. Prints decode tokens/s per side, the per-rep ratio on / off (target: no
loss, >= ~0.95 within this machine's noise) and the tokens computed again.

    python -m bench.answer_cost [--reps 4] [--chats 24] [--tokens 128]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import tempfile
import time

import grpc

from bench.common import settle
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

STREAMS = 8


def chats_rate(stub, rep: int, chats: int, tokens: int) -> float:
    requests = [pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=f"Story {rep}-{i}: tell me about a {i}-legged robot.")]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    ) for i in range(chats)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        generated = sum(pool.map(lambda r: list(stub.GenerateStream(r, timeout=600))[-1].generated_tokens, requests))
    return generated / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--chats", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    flags = ("--max-batch-size", str(STREAMS), "--threads", "2", "--prefix-cache-exact")
    with tempfile.TemporaryDirectory() as tmp:
        servers = {"on": start_server(pathlib.Path(tmp), *flags),
                   "off": start_server(pathlib.Path(tmp), *flags, "--prefix-cache-generated", "false")}
        try:
            stubs = {side: pb_grpc.GenerationServiceStub(grpc.insecure_channel(s.address)) for side, s in servers.items()}
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for rep in range(args.reps):
                for side in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                    rates[side].append(chats_rate(stubs[side], rep, args.chats, args.tokens))
                    settle(stubs[side])
                    print(f"rep {rep} {side}: {rates[side][-1]:.1f} tok/s", flush=True)
            ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
            print(f"on / off per rep: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")
            retiled = stubs["on"].GetServerStatus(pb.GetServerStatusRequest()).retiled_tokens_total
            print(f"computed again as prompt rows: {retiled} tokens of {args.reps * args.chats * args.tokens} generated")
        finally:
            for server in servers.values():
                stop_server(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
