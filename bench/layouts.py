"""llama.cpp on the CPU, with the engine in a process of its own (the default) against the engine in the
server's process (`--engine-process false`), in one run: the first token of a short prompt and decode
tokens/s, at 1 and 8 streams, the two servers side by side on the same model and settings, each burst
to each in turn (which goes first alternates).

Prints each side's medians and split / in-process as a speed ratio (1.0: the split costs nothing; first
token: the in-process time over the split's). Against llama-server, the split is then that ratio times
the in-process layout's figure (bench.first_token, bench.streaming).

    python -m bench.layouts [--reps 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import tempfile
import time

import grpc

from bench.common import PROMPTS, greedy_request
from bench.first_token import first_token_s
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SIDES = {"split": (), "in-process": ("--engine-process", "false")}
FLAGS = ("--context-length", "1024", "--max-batch-size", "8", "--threads", "2")
STREAMS = (1, 8)


def burst_first_tokens(stub: pb_grpc.GenerationServiceStub, streams: int, rep: int) -> float:
    """The median first-token time of `streams` fresh short prompts sent at once."""
    prompts = [f"Request {rep}-{i} of {time.monotonic_ns()}: {PROMPTS[i % len(PROMPTS)]}" for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        return statistics.median(pool.map(lambda prompt: first_token_s(stub, prompt), prompts))


def decode_rate(stub: pb_grpc.GenerationServiceStub, streams: int, tokens: int) -> float:
    """Tokens/s of `streams` concurrent greedy streams after the last one's first token."""

    def first_token_at(prompt: str) -> float:
        """When the stream's first token came (it is read to its end)."""
        first = None
        for message in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300):
            if message.generated_tokens and first is None:
                first = time.perf_counter()
        assert first is not None
        return first

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {time.monotonic_ns()}" for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        last_first = max(pool.map(first_token_at, prompts))
    return streams * (tokens - 1) / (time.perf_counter() - last_first)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.layouts")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        servers = {side: start_server(pathlib.Path(tmp), *FLAGS, *flags) for side, flags in SIDES.items()}
        channels = {side: grpc.insecure_channel(server.address) for side, server in servers.items()}
        stubs = {side: pb_grpc.GenerationServiceStub(channel) for side, channel in channels.items()}
        try:
            for stub in stubs.values():  # warm: first calls, the threads' tuning
                decode_rate(stub, 2, 16)
            print(f"llama.cpp, {' '.join(FLAGS)}; {args.reps} reps, {args.tokens} tokens a stream for decode")
            print("| measure | split | in-process | split / in-process (speed) |\n|---|---|---|---|")
            for streams in STREAMS:
                firsts: dict[str, list[float]] = {side: [] for side in SIDES}
                rates: dict[str, list[float]] = {side: [] for side in SIDES}
                for rep in range(args.reps):
                    order = list(SIDES) if rep % 2 == 0 else list(SIDES)[::-1]
                    for side in order:
                        firsts[side].append(burst_first_tokens(stubs[side], streams, rep))
                    for side in order:
                        rates[side].append(decode_rate(stubs[side], streams, args.tokens))
                first = {side: statistics.median(times) for side, times in firsts.items()}
                rate = {side: statistics.median(values) for side, values in rates.items()}
                print(f"| first token, {streams} at once (ms) | {first['split'] * 1e3:.1f} | {first['in-process'] * 1e3:.1f} "
                      f"| {first['in-process'] / first['split']:.3f} |")
                print(f"| decode, {streams} streams (tok/s) | {rate['split']:.1f} | {rate['in-process']:.1f} "
                      f"| {rate['split'] / rate['in-process']:.3f} |", flush=True)
        finally:
            for channel in channels.values():
                channel.close()
            for server in servers.values():
                stop_server(server)


if __name__ == "__main__":
    main()
