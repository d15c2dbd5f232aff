"""Constrained decoding benchmark on the embedded model, every figure from one run.

Prints:
  1. decode tokens/s under a JSON schema divided by unconstrained, same prompt and length,
     at 1 and 8 concurrent streams (target >= 0.95)
  2. mask time per step (filling and applying the token mask), from the responses' timings
  3. cold compile time over the real schema corpus (p50, p99, max)

    python -m bench.constraints [--tokens 128] [--reps 3]
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
from backend.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec
from backend.llamacpp.model import GgufModel
from bench.common import timed_request
from tests.harness.servers import SHARED_DATA, start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Long enough that no stream can finish before the token budget: lengths stay equal.
PEOPLE = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "format": "email"},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "member"],
        "additionalProperties": False,
    },
}
PROMPT = "List the members of the club as JSON."


def request(tokens: int, constrained: bool) -> pb.GenerateStreamRequest:
    message = pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=not constrained),
    )
    if constrained:
        message.constraint.json_schema = json.dumps(PEOPLE)
    return message


def one_stream(stub, tokens: int, constrained: bool) -> tuple[float, pb.Finish]:
    """Decode tokens/s seen by the caller (first message to last), and the final Finish."""
    _, rate, last = timed_request(stub, request(tokens, constrained))
    return rate, last.finish


def aggregate(stub, streams: int, tokens: int, constrained: bool) -> tuple[float, list[pb.Finish]]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: one_stream(stub, tokens, constrained), range(streams)))
    return streams * tokens / (time.perf_counter() - start), [finish for _, finish in results]


def cold_compile_times() -> list[float]:
    model = GgufModel(default_model_path())
    compiler = ConstraintCompiler(model.constraint_tokenizer(), cache_size=1)
    times = []
    for path in sorted((SHARED_DATA / "jsonschema").glob("*.json")):
        spec = ConstraintSpec("json_schema", json.dumps(json.loads(path.read_text())["schema"]))
        start = time.perf_counter()
        try:
            compiler.compile(spec)
        except ConstraintError:
            continue
        times.append(time.perf_counter() - start)
    model.close()
    return sorted(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"model {default_model_path().name}, {args.tokens} tokens per stream, {os.cpu_count()} cores")
    server = start_server(pathlib.Path(os.environ.get("TMPDIR", "/tmp")), "--context-length", "1024")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            one_stream(stub, 8, True)  # compile once and warm up
            for streams in (1, 8):
                plain, constrained, masks = [], [], []
                for _ in range(args.reps):  # alternate so that noise hits both alike
                    plain.append(aggregate(stub, streams, args.tokens, False)[0])
                    rate, finishes = aggregate(stub, streams, args.tokens, True)
                    constrained.append(rate)
                    masks += [f.timings.constraint_mask_ms / f.usage.completion_tokens for f in finishes]
                p, c = statistics.median(plain), statistics.median(constrained)
                print(
                    f"{streams} stream(s): unconstrained {p:.1f} tok/s, JSON schema {c:.1f} tok/s, "
                    f"ratio {c / p:.3f} (target >= 0.95); mask {statistics.median(masks) * 1000:.0f} us/token median"
                )
    finally:
        stop_server(server)
    times = cold_compile_times()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1000  # noqa: E731
    print(f"cold compile over {len(times)} real schemas: p50 {pick(0.5):.2f} ms, p99 {pick(0.99):.2f} ms, "
          f"max {times[-1] * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
