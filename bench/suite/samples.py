"""n samples of one prompt.
One request with `n = 4` against 4 separate ones sent at once, a fresh ~1,000-token prompt each (batch 4, 32 tokens).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import secrets
import statistics
import time

from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="Prefix cache and affinity",
    smoke=("--reps", "1", "--prompt-tokens", "200", "--new-tokens", "8", "--prefix-cache", "on"),
    order=2,
)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--prefix-cache", default="off,on", help="the server's prefix cache, comma-separated runs")


def prompt(stub, tokens: int) -> str:
    """About `tokens` tokens, unique to this call."""
    words = [f"Log {secrets.token_hex(4)}:"]
    while True:
        words += [f"entry {len(words)} reads {len(words) * 7 % 97} units;" for _ in range(40)]
        text = " ".join(words) + " Summary:"
        if stub.Tokenize(pb.TokenizeRequest(text=text)).count >= tokens:
            return text


def request(text: str, n: int, seed: int, new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=text, n=n, sampling=pb.SamplingParams(temperature=0.8, seed=seed),
                              stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))


def computed_rows(stub, call) -> tuple[float, int]:
    """Wall seconds of `call()` and the prompt rows the engine computed meanwhile."""
    before = stub.GetServerStatus(pb.GetServerStatusRequest())
    start = time.perf_counter()
    call()
    wall = time.perf_counter() - start
    after = stub.GetServerStatus(pb.GetServerStatusRequest())
    return wall, (after.prompt_tokens_total - before.prompt_tokens_total) - (
        after.cached_prompt_tokens_total - before.cached_prompt_tokens_total)


def one_setting(stub, args: argparse.Namespace) -> tuple[list, float]:
    """Medians of the n-samples request and of the separate ones, alternated: (table row, rows / (n x length))."""
    n = args.samples
    together, apart, lengths = [], [], []
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for rep in range(args.reps):
            first, second = prompt(stub, args.prompt_tokens), prompt(stub, args.prompt_tokens)
            lengths.append(stub.Tokenize(pb.TokenizeRequest(text=first)).count)

            def joint(text: str = first, rep: int = rep) -> None:
                stub.Generate(request(text, n, rep, args.new_tokens), timeout=600)

            def separate(text: str = second, rep: int = rep) -> None:
                list(pool.map(lambda i: stub.Generate(request(text, 1, rep + i, args.new_tokens), timeout=600), range(n)))

            for side in (joint, separate) if rep % 2 == 0 else (separate, joint):
                (together if side is joint else apart).append(computed_rows(stub, side))
    wall_n, rows_n = statistics.median(w for w, _ in together), statistics.median(r for _, r in together)
    wall_1, rows_1 = statistics.median(w for w, _ in apart), statistics.median(r for _, r in apart)
    row = [round(statistics.median(lengths)), round(wall_n, 2), round(wall_1, 2), round(wall_n / wall_1, 3),
           round(rows_n), round(rows_1), round(rows_n / rows_1, 3)]
    return row, rows_n / (n * statistics.median(lengths))


def measure(run: Run, args: argparse.Namespace) -> None:
    rows, fractions = [], {}
    for setting in args.prefix_cache.split(","):
        with Sides() as sides:
            served = sides.tokenspout("--context-length", "2048", "--max-batch-size", str(max(4, args.samples)),
                                      *(("--prefix-cache", "false") if setting == "off" else ()))
            served.stub.Generate(request("warm up", 1, 1, 4), timeout=300)
            row, fractions[setting] = one_setting(served.stub, args)
            rows.append([setting, *row])
    n = args.samples
    run.table("", ["prefix cache", "prompt tokens", f"n = {n}, s", "separate, s", "wall ratio",
               f"n = {n}, rows", "separate, rows", "rows ratio"], rows)
    setting = "off" if "off" in fractions else next(iter(fractions))  # the target is the cache's absence
    run.target(f"prompt rows computed for n = {n} / ({n} x prompt length), prefix cache {setting}", fractions[setting],
               "<=", 0.3)
