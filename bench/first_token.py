"""First token of a short prompt, paired: tokenspout as configured, tokenspout with `--first-token-hold-ms 0`,
and llama-server, in one run, each request in turn to each (rotating which goes first), with no pause and
with a pause before each request (an idle server, as a caller who types). Prints each side's median and
the two tokenspout ratios against llama-server (time: lower is better).

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
from bench.common import PROMPTS, greedy_request
from bench.llama_server import start_llama_server
from bench.streaming import CONTEXT, SLOTS, THREADS
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

TOKENS = 8


def first_token_s(stub: pb_grpc.GenerationServiceStub, prompt: str) -> float:
    """Seconds to the first message with a token, reading the stream to its end (as for llama-server)."""
    start = time.perf_counter()
    first = None
    for message in stub.GenerateStream(greedy_request(prompt, TOKENS), timeout=300):
        if message.generated_tokens and first is None:
            first = time.perf_counter() - start
    assert first is not None
    return first


def paired(sides: list[Callable[[str], float]], prompts: int, pause_s: float) -> list[float]:
    """Each side's median first-token time over `prompts` unique prompts, each sent to every side in turn."""
    times: list[list[float]] = [[] for _ in sides]
    for i in range(prompts):
        prompt = f"Request {i} of {time.monotonic_ns()}: {PROMPTS[i % len(PROMPTS)]}"
        for k in range(len(sides)):
            side = (i + k) % len(sides)
            time.sleep(pause_s)
            times[side].append(sides[side](prompt))
    return [statistics.median(t) for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench.first_token")
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--pauses", default="0,0.3")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    flags = ("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(THREADS))
    with tempfile.TemporaryDirectory() as tmp:
        held = start_server(pathlib.Path(tmp), *flags)
        unheld = start_server(pathlib.Path(tmp), *flags, "--first-token-hold-ms", "0")
        reference = start_llama_server(args.llama_server, default_model_path(), CONTEXT, SLOTS, THREADS)
        stubs = [pb_grpc.GenerationServiceStub(grpc.insecure_channel(s.address)) for s in (held, unheld)]
        sides: list[Callable[[str], float]] = [
            lambda p: first_token_s(stubs[0], p),
            lambda p: first_token_s(stubs[1], p),
            lambda p: reference.stream(p, TOKENS, cache_prompt=False).ttft_s,
        ]
        try:
            paired(sides, 4, 0.0)  # warm all three
            print("| pause | tokenspout | hold 0 | llama-server | ratio | ratio, hold 0 |\n|---|---|---|---|---|---|")
            for _ in range(args.rounds):
                for pause in (float(p) for p in args.pauses.split(",")):
                    ours, unheld_s, theirs = paired(sides, args.prompts, pause)
                    print(f"| {pause:g} s | {ours * 1000:.1f} ms | {unheld_s * 1000:.1f} ms | {theirs * 1000:.1f} ms "
                          f"| {ours / theirs:.3f} | {unheld_s / theirs:.3f} |", flush=True)
        finally:
            reference.stop()
            stop_server(held)
            stop_server(unheld)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
