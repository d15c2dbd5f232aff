"""What the service's path adds to one stream: against the engine in-process, and against a bare gRPC server.
In turn: tokenspout and `backend.build_engine`'s engine in-process; tokenspout's fake engine and minimal_server (1 ms steps).
"""

from __future__ import annotations

import argparse
import queue
import time

import grpc

from backend import EngineConfig, GenerationRequest, SamplingParams, StopParams, TokenEvent, build_engine
from bench.harness.pairing import alternate, medians
from bench.harness.record import Benchmark, Run
from bench.harness.sides import CONTEXT, SLOTS, THREADS, Sides
from bench.harness.streams import decode_rate, timed_stream
from bench.suite.first_token import first_token_s
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(area="Streaming overhead", order=1,
                      smoke=("--reps", "1", "--ttft-reps", "1", "--tokens", "8", "--calls", "4", "--warm", "1"))
DECODE_PROMPT, FIRST_TOKEN_PROMPT = "The history of the printing press", "How do volcanoes form?"


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=128, help="tokens a stream, for decode")
    parser.add_argument("--reps", type=int, default=9, help="decode pairs")
    parser.add_argument("--ttft-reps", type=int, default=20, help="first-token pairs")
    parser.add_argument("--calls", type=int, default=300, help="first-message pairs, against the bare server")
    parser.add_argument("--warm", type=int, default=20, help="calls to each server before those")
    parser.add_argument("--step-s", type=float, default=0.001, help="the fake engine's and the bare server's step")


def in_process(engine, prompt: str, tokens: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """One greedy stream in-process: (seconds to the first token, decode tokens/s after it)."""
    events: queue.Queue = queue.Queue()
    request = GenerationRequest(
        f"bench-{time.monotonic_ns()}", tuple(engine.tokenize(prompt)), SamplingParams(temperature=0.0),
        StopParams(max_new_tokens=tokens, ignore_eos=True),
        speculation=engine.info.default_speculation,  # as the server fills in for a request that names none
    )
    start = time.perf_counter()
    engine.submit(request, lambda event: events.put((time.perf_counter(), event)))
    stamps = []
    while True:
        stamp, event = events.get()
        stamps.append(stamp)
        if not isinstance(event, TokenEvent) or event.finish is not None:  # an error, or the last
            break
    return stamps[0] - start, decode_rate(start, stamps, tokens)


def against_the_engine(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """Medians of decode tokens/s and of first-token seconds, "in-process" and "gRPC"."""
    with Sides() as sides:
        stub = sides.tokenspout().stub
        engine = build_engine(EngineConfig.of(context_length=CONTEXT, max_batch_size=SLOTS, threads=THREADS))
        sides.callback(engine.close)
        timed_stream(stub, DECODE_PROMPT, 8)  # warm both paths
        in_process(engine, DECODE_PROMPT, 8)
        decode = medians(alternate({"in-process": lambda _: in_process(engine, DECODE_PROMPT, args.tokens)[1],
                                    "gRPC": lambda _: timed_stream(stub, DECODE_PROMPT, args.tokens)[1]}, range(args.reps)))
        first = medians(alternate({"in-process": lambda _: in_process(engine, FIRST_TOKEN_PROMPT, 2)[0],
                                   "gRPC": lambda _: timed_stream(stub, FIRST_TOKEN_PROMPT, 2)[0]}, range(args.ttft_reps)))
    return decode, first


def against_a_bare_server(args: argparse.Namespace) -> dict[str, float]:
    """Median first-message seconds of 8-token calls, one at a time, "tokenspout" (fake engine) and "minimal"."""
    with Sides() as sides:
        ours = sides.tokenspout(fake_engine=True, faults=("--step-s", str(args.step_s))).stub
        channel = grpc.insecure_channel(sides.minimal_server(args.step_s)[1])
        sides.callback(channel.close)
        bare = pb_grpc.GenerationServiceStub(channel)
        calls = {"tokenspout": lambda i: first_token_s(ours, f"Hello there {i}"),
                 "minimal": lambda i: first_token_s(bare, f"Hello there {i}")}
        alternate(calls, range(args.warm))  # channels, the first calls' paths
        return medians(alternate(calls, range(args.calls)))


def measure(run: Run, args: argparse.Namespace) -> None:
    decode, first = against_the_engine(args)
    message = against_a_bare_server(args)
    ratio, added_ms = decode["gRPC"] / decode["in-process"], (first["gRPC"] - first["in-process"]) * 1000
    run.table("", ["one stream (medians)", "baseline", "tokenspout", "ratio", "added, ms"], [
        [f"decode tok/s ({args.reps} pairs); baseline: in-process", round(decode["in-process"], 1),
         round(decode["gRPC"], 1), round(ratio, 3), None],
        [f"first token ms ({args.ttft_reps} pairs); in-process", round(first["in-process"] * 1000, 2),
         round(first["gRPC"] * 1000, 2), round(first["gRPC"] / first["in-process"], 3), round(added_ms, 2)],
        [f"first message ms ({args.calls} pairs); a bare server", round(message["minimal"] * 1000, 3),
         round(message["tokenspout"] * 1000, 3), round(message["tokenspout"] / message["minimal"], 3),
         round((message["tokenspout"] - message["minimal"]) * 1000, 3)],
    ])
    run.target("single-stream decode, gRPC / in-process", ratio, ">=", 0.97)
    run.target("time to first token added by gRPC, ms", added_ms, "<=", 5.0)
