"""What the extra samplers cost on the embedded model, from one run.

Prints decode tokens/s with DRY, XTC, mirostat and the repetition penalties, each divided
by plain sampling (temperature 1, same seed) measured alternately in the same run, at 1 and
8 concurrent streams.

    python -m bench.samplers [--tokens 128] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

import grpc

from bench.common import aggregate_rate
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

SETTINGS = {
    "plain": {},
    "penalties (last 64)": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "dry (whole context)": {"dry": pb.DrySampler(multiplier=0.8)},
    "xtc": {"xtc": pb.XtcSampler(probability=0.5, threshold=0.1)},
    "mirostat 2": {"mirostat": pb.MirostatSampler()},
    # XTC and mirostat sort the whole vocabulary each step; a truncation sampler first shrinks it.
    "min_p 0.05": {"min_p": 0.05},
    "min_p 0.05 + xtc": {"min_p": 0.05, "xtc": pb.XtcSampler(probability=0.5, threshold=0.1)},
    "min_p 0.05 + mirostat": {"min_p": 0.05, "mirostat": pb.MirostatSampler()},
}


def request(prompt: str, tokens: int, settings: dict) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=1.0, seed=11, **settings),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    )


def rate(stub, streams: int, tokens: int, settings: dict) -> float:
    return aggregate_rate(stub, streams, tokens, make_request=lambda prompt, n: request(prompt, n, settings))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    server = start_server(pathlib.Path(os.environ.get("TMPDIR", "/tmp")), "--context-length", "1024")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            rate(stub, 1, 8, {})  # warm-up
            for streams in (1, 8):
                runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
                for _ in range(args.reps):  # round-robin so that machine noise hits every setting alike
                    for name, settings in SETTINGS.items():
                        runs[name].append(rate(stub, streams, args.tokens, settings))
                plain = statistics.median(runs["plain"])
                print(f"{streams} stream(s): plain {plain:.1f} tok/s")
                for name in list(SETTINGS)[1:]:
                    value = statistics.median(runs[name])
                    print(f"  {name:<22} {value:7.1f} tok/s  ratio {value / plain:.3f}")
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
