"""What each extra sampler costs a token.
Decode tokens/s with each over plain sampling (temperature 1, same seed, 128 tokens), the settings in turn; medians of 3.
"""

from __future__ import annotations

import argparse

from bench.harness.pairing import alternate, medians
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import aggregate_rate
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(area="Samplers", smoke=("--tokens", "8", "--reps", "1", "--streams", "1"), order=1)
SETTINGS = {
    "plain": {},
    "penalties (last 64)": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "DRY (whole context)": {"dry": pb.DrySampler(multiplier=0.8)},
    "XTC": {"xtc": pb.XtcSampler(probability=0.5, threshold=0.1)},
    "mirostat 2": {"mirostat": pb.MirostatSampler()},
    # XTC and mirostat sort the whole vocabulary each step; a truncation sampler first shrinks it.
    "min_p 0.05": {"min_p": 0.05},
    "min_p 0.05 + XTC": {"min_p": 0.05, "xtc": pb.XtcSampler(probability=0.5, threshold=0.1)},
    "min_p 0.05 + mirostat": {"min_p": 0.05, "mirostat": pb.MirostatSampler()},
}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", default="1,8", help="concurrent streams, comma-separated")


def request(prompt: str, tokens: int, settings: dict) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=1.0, seed=11, **settings),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    )


def rate(stub, streams: int, tokens: int, settings: dict) -> float:
    return aggregate_rate(stub, streams, tokens, make_request=lambda prompt, n: request(prompt, n, settings))


def measure(run: Run, args: argparse.Namespace) -> None:
    concurrency = [int(n) for n in args.streams.split(",")]
    by_streams: dict[int, dict[str, float]] = {}
    with Sides() as sides:
        stub = sides.tokenspout().stub
        rate(stub, 1, 8, {})  # warm up
        for n in concurrency:
            settings = {name: lambda _, s=s, n=n: rate(stub, n, args.tokens, s) for name, s in SETTINGS.items()}
            by_streams[n] = medians(alternate(settings, range(args.reps)))
    others = list(SETTINGS)[1:]
    run.table("", ["streams", "plain, tok/s", *(f"{name} / plain" for name in others)], [
        [n, round(got["plain"], 1), *(round(got[name] / got["plain"], 3) for name in others)] for n, got in by_streams.items()
    ])
