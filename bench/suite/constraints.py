"""What a JSON schema costs decode, and what compiling one costs.
128 greedy tokens under a schema that outruns them and unconstrained, in turn; mask time from timings; the corpus compiled cold.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

import grpc

from bench.harness.pairing import alternate, medians
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import timed_request
from tests.harness.servers import SHARED_DATA
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(area="Constraints", smoke=("--tokens", "16", "--reps", "1", "--streams", "1", "--schemas", "20"),
                      order=1)
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


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", default="1,8", help="concurrent streams, comma-separated")
    parser.add_argument("--schemas", type=int, default=0, help="compile only the first N schemas of the corpus (0: all)")


def request(tokens: int, constrained: bool) -> pb.GenerateStreamRequest:
    message = pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=not constrained),
    )
    if constrained:
        message.constraint.json_schema = json.dumps(PEOPLE)
    return message


def aggregate(stub, streams: int, tokens: int, constrained: bool, masks: list[float]) -> float:
    """Tokens/s of `streams` concurrent streams, start to last token; each stream's mask ms a token into `masks`."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda _: timed_request(stub, request(tokens, constrained)), range(streams)))
    finishes = [last.finish for *_, last in done]
    masks += [f.timings.constraint_mask_ms / f.usage.completion_tokens for f in finishes if constrained]
    return streams * tokens / (time.perf_counter() - start)


def cold_compiles_ms(stub, limit: int) -> list[float]:
    """Each schema of the corpus compiled once by the server (none is cached: each is new to it); refused ones skipped."""
    paths = sorted((SHARED_DATA / "jsonschema").glob("*.json"))
    times = []
    for path in paths[:limit] if limit else paths:
        constraint = pb.Constraint(json_schema=json.dumps(json.loads(path.read_text())["schema"]))
        try:
            reply = stub.CompileConstraint(pb.CompileConstraintRequest(constraint=constraint), timeout=60)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            continue
        assert not reply.cached, path.name
        times.append(reply.compile_ms)
    return sorted(times)


def measure(run: Run, args: argparse.Namespace) -> None:
    rows: list[list] = []
    with Sides() as sides:
        stub = sides.tokenspout().stub
        timed_request(stub, request(8, True))  # compile once and warm up
        for n in (int(n) for n in args.streams.split(",")):
            masks: list[float] = []
            decode = {"plain": lambda _, n=n, masks=masks: aggregate(stub, n, args.tokens, False, masks),
                      "schema": lambda _, n=n, masks=masks: aggregate(stub, n, args.tokens, True, masks)}
            median = medians(alternate(decode, range(args.reps)))
            ratio = median["schema"] / median["plain"]
            mask_ms = statistics.median(masks)
            rows.append([n, round(median["plain"], 1), round(median["schema"], 1), round(ratio, 3), round(mask_ms, 3)])
        times = cold_compiles_ms(stub, args.schemas)
    run.target("JSON schema / unconstrained, the lower over the stream counts", min(row[3] for row in rows), ">=", 0.95)
    run.table("", ["streams", "unconstrained, tok/s", "JSON schema, tok/s", "ratio", "mask, ms a token"], rows)
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    run.note(f"Cold compile of the {len(times)} real schemas that compile: p50 {pick(0.5):.2f} ms, p99 {pick(0.99):.2f}, "
             f"max {times[-1]:.2f}.")
