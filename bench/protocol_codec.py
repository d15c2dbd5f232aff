"""What one engine step's message costs to encode and decode, by how the events are written: the protocol's
msgspec Structs as arrays (backend.events, backend.process.protocol), the same fields as dataclasses that
msgspec writes as maps (what the events were before), and pickle. Each way encodes and decodes a step of
N token events for N streams (one token each, as a decode step gives), in this process, `--reps` times.

    python -m bench.protocol_codec [--streams 64] [--reps 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pickle
import time
from collections.abc import Callable

import msgspec

from backend.events import GeneratedToken, TokenEvent
from backend.process import protocol as wire


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


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.protocol_codec")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
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
    print(f"one step of {n} token events, {args.reps} reps")
    print("| encoding | bytes | encode us | decode us |\n|---|---|---|---|")
    for name, (encode, decode) in ways.items():
        frame = encode()
        print(f"| {name} | {len(frame)} | {per_step_us(encode, args.reps):.1f} "
              f"| {per_step_us(functools.partial(decode, frame), args.reps):.1f} |", flush=True)


if __name__ == "__main__":
    main()
