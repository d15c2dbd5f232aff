"""What enforcing a tool call costs: decode tokens/s of the same chat with tools, free vs under the grammar.

Three sides, alternated rep by rep in one run on the embedded model (SmolLM2, fallback prompt, hermes):
  free      tool_choice none: the tools are not shown and nothing is enforced
  auto      the lazy grammar: free text until a call starts, then enforced
  required  the call forced from the first token, its arguments under the tool's schema
Each stream runs to exactly --tokens (EOS suppressed by min_new_tokens; the schema's long array keeps
the call open), so every side decodes the same number of tokens, one per step (no speculation).

    python -m bench.tool_calls [--tokens 128] [--reps 3] [--streams 1 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import sys
import time

import grpc

from backend.common.models import default_model_path
from bench.common import timed_request
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

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


def request(side: str, tokens: int) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Save the members of the club.")], tools=[TOOL],
                     tool_choice=pb.ToolChoice(mode=CHOICES[side])),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens),
        # One token a step on every side: n-gram proposals pay off on repetitive JSON and would hide the mask cost.
        speculation=pb.Speculation(mode=pb.SPECULATION_MODE_OFF),
    )


def aggregate(stub, side: str, streams: int, tokens: int) -> tuple[float, float, float]:
    """Tokens/s of `streams` concurrent streams, the mask time per token (ms), and the share of decode
    time spent on masks (a figure the host's noise hardly moves)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: timed_request(stub, request(side, tokens)), range(streams)))
    rate = streams * tokens / (time.perf_counter() - start)
    timings = [(last.finish.timings, last.finish.usage.completion_tokens) for _, _, last in results]
    masks = [t.constraint_mask_ms / n for t, n in timings]
    shares = [t.constraint_mask_ms / t.decode_ms for t, _ in timings]
    return rate, statistics.median(masks), statistics.median(shares)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    print(f"model {default_model_path().name}, {args.tokens} tokens per stream, {os.cpu_count()} cores")
    server = start_server(pathlib.Path(os.environ.get("TMPDIR", "/tmp")), "--context-length", "1024")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            for side in CHOICES:  # compile the grammars and warm up
                aggregate(stub, side, 1, 8)
            for streams in args.streams:
                rates: dict[str, list[float]] = {side: [] for side in CHOICES}
                masks: dict[str, list[float]] = {side: [] for side in CHOICES}
                shares: dict[str, list[float]] = {side: [] for side in CHOICES}
                for _ in range(args.reps):  # alternate so that noise hits every side alike
                    for side in CHOICES:
                        rate, mask, share = aggregate(stub, side, streams, args.tokens)
                        rates[side].append(rate)
                        masks[side].append(mask)
                        shares[side].append(share)
                for side in CHOICES:
                    # Each rep's ratio to the free side measured just before it, then their median and range.
                    ratios = sorted(r / f for r, f in zip(rates[side], rates["free"], strict=True))
                    print(f"{streams} stream(s) {side:8s}: {statistics.median(rates[side]):6.1f} tok/s, "
                          f"ratio to free {statistics.median(ratios):.3f} (reps {ratios[0]:.2f}-{ratios[-1]:.2f}), "
                          f"mask {statistics.median(masks[side]) * 1000:.0f} us/token, "
                          f"{statistics.median(shares[side]) * 100:.1f}% of decode time")
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
