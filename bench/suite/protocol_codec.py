"""What one engine step's message costs to encode and decode on the engine process's wire.
A step of N token events, `--reps` times, three ways: the protocol's msgspec Structs as arrays (backend.process.protocol), the
same fields as dataclasses msgspec writes as maps (the events before), pickle.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pickle
import time
from collections.abc import Callable

import msgspec

import backend.process.protocol as wire
from backend import GeneratedToken, TokenEvent
from bench.harness.record import Benchmark, Run

BENCHMARK = Benchmark(area="The engine in a process of its own", smoke=("--reps", "50"), order=3)


@dataclasses.dataclass(slots=True)
class _TokenAsDataclass:
    token_id: int
    piece: bytes
    logprob: float | None = None
    top_logprobs: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class _EventAsDataclass:
    tokens: tuple[_TokenAsDataclass, ...]
    text: str
    generated_tokens: int
    finish: None = None
    step: int = 0
    mask_s: float = 0.0
    accepted_drafts: int = 0
    index: int = 0
    prompt_tokens: tuple[_TokenAsDataclass, ...] = ()


def per_step_us(work: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        work()
    return (time.perf_counter() - start) / reps * 1e6


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=64, help="token events in the step")
    parser.add_argument("--reps", type=int, default=2000)


def measure(run: Run, args: argparse.Namespace) -> None:
    n = args.streams
    structs = wire.Events([(f"request-{i}", TokenEvent((GeneratedToken(1000 + i, b" the"),), " the", 17, None, 42))
                           for i in range(n)])
    dataclasses_ = [(f"request-{i}", _EventAsDataclass((_TokenAsDataclass(1000 + i, b" the"),), " the", 17, None, 42))
                    for i in range(n)]
    maps_decoder = msgspec.msgpack.Decoder(list[tuple[str, _EventAsDataclass]])
    ways = {
        "msgspec Structs as arrays (the protocol)": (lambda: wire.encode(structs), wire.decode_to_front_end),
        "msgspec dataclasses as maps": (lambda: msgspec.msgpack.encode(dataclasses_), maps_decoder.decode),
        "pickle (protocol 5)": (lambda: pickle.dumps(dataclasses_, protocol=5), pickle.loads),
    }
    rows: list[list] = []
    for name, (encode, decode) in ways.items():
        frame = encode()
        rows.append([name, len(frame), round(per_step_us(encode, args.reps), 1),
                     round(per_step_us(functools.partial(decode, frame), args.reps), 1)])
    run.table("", [f"a step of {n} token events, written as", "bytes", "encode, us", "decode, us"], rows)
