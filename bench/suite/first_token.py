"""First token of a short prompt, one request at a time, against llama-server at its defaults.
A prompt sharing nothing with earlier ones, then one extending it by a few words (bench.harness.prompt_kinds), each to
every side in turn, with no pause and a pause before each request. Sides: tokenspout at its defaults, with
`--prefix-cache-exact`, and llama-server. Speed: llama-server's median time over ours.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.harness.pairing import rotated
from bench.harness.prompt_kinds import extended, fresh_prompts
from bench.harness.record import Benchmark, Run
from bench.harness.sides import SERVER_FLAGS, Sides
from bench.harness.streams import greedy_request
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="Time to first token and decode against llama-server",
    needs=("llama-server",),
    smoke=("--prompts", "2", "--rounds", "1", "--pauses", "0"),
    order=1,
)
TOKENS = 8
KINDS = ("fresh", "extends")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=30, help="prompts of each kind per round and pause")
    parser.add_argument("--pauses", default="0,0.3", help="seconds before each request, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)


def first_token_s(stub: pb_grpc.GenerationServiceStub, prompt: str, tokens: int = TOKENS) -> float:
    """Seconds to the first message with a token of a `tokens`-token stream, reading it to its end (as for
    llama-server)."""
    start = time.perf_counter()
    first = None
    for message in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300):
        if message.generated_tokens and first is None:
            first = time.perf_counter() - start
    assert first is not None
    return first


def paired(sides: dict, prompts: list[str], pause_s: float) -> dict[str, dict[str, float]]:
    """Each side's median first-token time per kind: each fresh prompt goes to every side in turn, then its
    extension does, so each side's extension follows its own fresh prompt."""
    times: dict[str, dict[str, list[float]]] = {kind: {name: [] for name in sides} for kind in KINDS}
    for i, prompt in enumerate(prompts):
        for kind, text in zip(KINDS, (prompt, extended(prompt, i))):
            for name in rotated(list(sides), i):
                time.sleep(pause_s)
                times[kind][name].append(sides[name](text))
    return {kind: {name: statistics.median(t) for name, t in by_side.items()} for kind, by_side in times.items()}


def measure(run: Run, args: argparse.Namespace) -> None:
    pauses = [float(p) for p in args.pauses.split(",")]
    prompts = iter(fresh_prompts(4 + args.rounds * len(pauses) * args.prompts, seed=time.monotonic_ns()))
    with Sides() as sides:
        ours = sides.tokenspout().stub
        exact = sides.tokenspout(*SERVER_FLAGS, "--prefix-cache-exact").stub
        reference = sides.llama_server(args.llama_server)
        measures = {
            "tokenspout": lambda p: first_token_s(ours, p),
            "exact": lambda p: first_token_s(exact, p),
            "llama-server": lambda p: reference.stream(p, TOKENS).ttft_s,  # at its defaults: cache_prompt on
        }
        paired(measures, [next(prompts) for _ in range(4)], 0.0)  # warm all three
        rows: list[list] = []
        speeds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for pause in pauses:
                for kind, median in paired(measures, [next(prompts) for _ in range(args.prompts)], pause).items():
                    mine, exact_s, theirs = median["tokenspout"], median["exact"], median["llama-server"]
                    speeds[kind].append(theirs / mine)
                    rows.append([f"{pause:g} s", kind, round(mine * 1000, 1), round(exact_s * 1000, 1),
                                 round(theirs * 1000, 1), round(theirs / mine, 3), round(theirs / exact_s, 3)])
    run.table("",
              ["pause", "prompt", "tokenspout", "exact", "llama-server", "speed", "speed, exact"], rows)
    for kind in KINDS:
        run.target(f"first token, {kind} short prompt, 1 stream, slowest round", min(speeds[kind]), ">=", 1.0)
