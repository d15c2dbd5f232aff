"""First token of a short prompt, one request at a time, against llama-server at its defaults (`cache_prompt`
on, as every client of it gets it), in one run. Two kinds of prompt (bench.prompt_kinds): one that shares
nothing with any earlier prompt, then one that extends it by a few words, each sent to every side in turn
(rotating which goes first), with no pause and with a pause before each request (an idle server, as a caller
who types). Sides: tokenspout at its defaults (prefix reuse to the token), tokenspout with
`--prefix-cache-exact` (the greedy guarantee's price) and llama-server. Prints each side's median and each
tokenspout side's speed against llama-server (its time / ours: higher is better, target >= 1.0).

    python -m bench.first_token --llama-server PATH [--prompts 30] [--pauses 0,0.3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import grpc

from backend.common.models import default_model_path
from bench.common import greedy_request
from bench.llama_server import start_llama_server
from bench.prompt_kinds import extended, fresh_prompts
from bench.streaming import CONTEXT, SLOTS, THREADS
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

TOKENS = 8
SIDES = ("tokenspout", "exact", "llama-server")


def first_token_s(stub: pb_grpc.GenerationServiceStub, prompt: str) -> float:
    """Seconds to the first message with a token, reading the stream to its end (as for llama-server)."""
    start = time.perf_counter()
    first = None
    for message in stub.GenerateStream(greedy_request(prompt, TOKENS), timeout=300):
        if message.generated_tokens and first is None:
            first = time.perf_counter() - start
    assert first is not None
    return first


def paired(sides: list[Callable[[str], float]], prompts: list[str], pause_s: float) -> dict[str, list[float]]:
    """Each side's median first-token time for the fresh prompts and for their extensions: each fresh prompt goes to
    every side in turn, then its extension does, so each side's extension follows its own fresh prompt."""
    times: dict[str, list[list[float]]] = {kind: [[] for _ in sides] for kind in ("fresh", "extends")}
    for i, prompt in enumerate(prompts):
        for kind, text in (("fresh", prompt), ("extends", extended(prompt, i))):
            for k in range(len(sides)):
                side = (i + k) % len(sides)
                time.sleep(pause_s)
                times[kind][side].append(sides[side](text))
    return {kind: [statistics.median(t) for t in per_side] for kind, per_side in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench.first_token")
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--pauses", default="0,0.3")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pauses = [float(p) for p in args.pauses.split(",")]
    prompts = iter(fresh_prompts(4 + args.rounds * len(pauses) * args.prompts, seed=time.monotonic_ns()))
    flags = ("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(THREADS))
    with tempfile.TemporaryDirectory() as tmp:
        ours = start_server(pathlib.Path(tmp), *flags)
        exact = start_server(pathlib.Path(tmp), *flags, "--prefix-cache-exact")
        reference = start_llama_server(args.llama_server, default_model_path(), CONTEXT, SLOTS, THREADS)
        stubs = [pb_grpc.GenerationServiceStub(grpc.insecure_channel(s.address)) for s in (ours, exact)]
        sides: list[Callable[[str], float]] = [
            lambda p: first_token_s(stubs[0], p),
            lambda p: first_token_s(stubs[1], p),
            lambda p: reference.stream(p, TOKENS).ttft_s,  # at its defaults: cache_prompt on
        ]
        try:
            paired(sides, [next(prompts) for _ in range(4)], 0.0)  # warm all three
            print("| pause | prompt | tokenspout | exact | llama-server | speed | speed, exact |\n|---|---|---|---|---|---|---|")
            for _ in range(args.rounds):
                for pause in pauses:
                    medians = paired(sides, [next(prompts) for _ in range(args.prompts)], pause)
                    for kind, (mine, exact_s, theirs) in medians.items():
                        print(f"| {pause:g} s | {kind} | {mine * 1000:.1f} ms | {exact_s * 1000:.1f} ms | "
                              f"{theirs * 1000:.1f} ms | {theirs / mine:.3f} | {theirs / exact_s:.3f} |", flush=True)
        finally:
            reference.stop()
            stop_server(ours)
            stop_server(exact)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
