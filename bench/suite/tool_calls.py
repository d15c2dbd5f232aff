"""What enforcing a tool call costs: decode of one chat with a tool, free against under the grammar.
Alternated rep by rep, speculation off, every stream exactly --tokens: `free` (tool_choice none), `auto` (the lazy grammar: free
text until a call starts), `required` (the call forced from the first token, its arguments under a schema that keeps it open).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

from bench.harness.pairing import alternate, span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(area="Tool calls", smoke=("--tokens", "16", "--reps", "1"))
MEMBERS = {
    "type": "object",
    "properties": {
        "members": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "member": {"type": "boolean"},
                },
                "required": ["name", "age", "member"],
            },
        }
    },
    "required": ["members"],
}
TOOL = pb.Tool(name="save_members", description="Saves the club's members.", parameters=json.dumps(MEMBERS))
CHOICES = {"free": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO, "required": pb.TOOL_CHOICE_MODE_REQUIRED}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--streams", type=int, nargs="+", default=[1])


def request(side: str, tokens: int) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Save the members of the club.")], tools=[TOOL],
                     tool_choice=pb.ToolChoice(mode=CHOICES[side])),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens),
        # One token a step on every side: n-gram proposals pay off on repetitive JSON and would hide the mask cost.
        speculation=pb.Speculation(mode=pb.SPECULATION_MODE_OFF),
    )


def final_message(stub, request: pb.GenerateStreamRequest) -> pb.GenerateStreamResponse:
    """The last message of a stream that must run to max_new_tokens (a held-back tool call may arrive whole)."""
    for message in stub.GenerateStream(request, timeout=300):
        final = message
    assert final.generated_tokens == request.stopping.max_new_tokens, final.finish
    return final


def aggregate(stub, side: str, streams: int, tokens: int) -> tuple[float, float, float]:
    """Tokens/s of `streams` concurrent streams, the mask time per token (ms), and the share of decode time spent
    on masks (a figure the host's noise hardly moves)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        finals = list(pool.map(lambda _: final_message(stub, request(side, tokens)), range(streams)))
    rate = streams * tokens / (time.perf_counter() - start)
    timings = [(last.finish.timings, last.finish.usage.completion_tokens) for last in finals]
    return (rate, statistics.median(t.constraint_mask_ms / n for t, n in timings),
            statistics.median(t.constraint_mask_ms / t.decode_ms for t, _ in timings))


def measure(run: Run, args: argparse.Namespace) -> None:
    rows = []
    with Sides() as sides:
        stub = sides.tokenspout().stub
        for side in CHOICES:  # compile the grammars and warm up
            aggregate(stub, side, 1, 8)
        for streams in args.streams:
            masks: dict[str, list[tuple[float, float]]] = {side: [] for side in CHOICES}

            def side_rate(side: str, streams: int = streams, masks: dict = masks):
                rate, mask, share = aggregate(stub, side, streams, args.tokens)
                masks[side].append((mask, share))
                return rate

            rates = alternate({side: lambda _, side=side: side_rate(side) for side in CHOICES}, range(args.reps))
            free = statistics.median(rates["free"])
            for side in ("auto", "required"):
                ratios = [r / f for r, f in zip(rates[side], rates["free"], strict=True)]  # each rep against its free run
                rows.append([streams, side, round(free, 1), round(statistics.median(rates[side]), 1),
                             f"{statistics.median(ratios):.2f} ({span(ratios)})",
                             round(statistics.median(m for m, _ in masks[side]) * 1000),
                             f"{100 * statistics.median(s for _, s in masks[side]):.1f}%"])
    run.table("", ["streams", "side", "free tokens/s", "tokens/s", "decode / free, median of reps (range)",
                   "mask per token, us", "mask / decode time"], rows)
