"""Speed with n-gram speculation, against llama-server with and without its own.
Each rep, a new prompt per workload to tokenspout off / n-gram and llama-server plain / best spec, in turn; medians of ratios.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import time
from collections.abc import Callable

from bench.harness.llama_server import LlamaServer
from bench.harness.pairing import rotated
from bench.harness.record import Benchmark, Run
from bench.harness.sides import SERVER_FLAGS, Sides
from bench.harness.workloads import WORKLOADS
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="Speculative decoding",
    needs=("llama-server",),
    smoke=("--reps", "1", "--tokens", "8", "--json-tokens", "8", "--streams", "1", "--workloads", "copy,json"),
    order=1,
)
CALLER_HEADER = "x-bench-caller"
# The best of 10 settings on these workloads (bench/llama_server_settings.py).
BEST_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"
# Integers bounded, as real schemas bound them: unbounded, the embedded model wrote 100-digit numbers in
# most runs, so the workload measured a digit loop, not keys.
KEY_HEAVY_SCHEMA = {
    "type": "array", "minItems": 4, "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {
            "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999999},
            "customer_preferred_display_name": {"type": "string", "maxLength": 12},
            "subscription_renewal_is_automatic": {"type": "boolean"},
            "outstanding_balance_in_cents": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["customer_account_identifier", "customer_preferred_display_name",
                     "subscription_renewal_is_automatic", "outstanding_balance_in_cents"],
        "additionalProperties": False,
    },
}
JSON_PROMPTS = [f"List four customers of {place} as JSON." for place in
                ("a small gym", "a bakery", "a bicycle shop", "a language school", "a garden centre")]
TARGETS = [  # (workload, streams, numerator, denominator, bound)
    ("copy", 1, "ngram", "off", 1.3), ("copy", 1, "ngram", "llama-server spec", 1.1), ("copy", 8, "ngram", "off", 1.0),
]
OFF, NGRAM = pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_NGRAM


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec-args", default=BEST_SPEC, help="llama-server's speculation flags")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--json-tokens", type=int, default=200, help="most tokens of a JSON answer")
    parser.add_argument("--streams", default="1,8", help="concurrent streams, comma-separated")
    parser.add_argument("--workloads", default=",".join([*WORKLOADS, "json"]))
    parser.add_argument("--model", type=pathlib.Path, help="another GGUF for both servers (default: the embedded model)")


def chat(prompt: str) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=prompt)])


def tokenspout_run(stub, prompt: str, tokens: int, streams: int, mode: int, caller: str,
                   constrained: bool = False) -> tuple[float, pb.Usage]:
    """(decode tokens/s over all streams, the first stream's usage); each run a caller of its own, so no pool of
    n-grams kept across a caller's requests has seen the text."""
    request = pb.GenerateStreamRequest(
        chat=chat(prompt), sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=not constrained),
        speculation=pb.Speculation(mode=mode),
    )
    if constrained:
        request.constraint.json_schema = json.dumps(KEY_HEAVY_SCHEMA)

    def one(_) -> tuple[float, float, pb.Usage]:
        first, usage = None, pb.Usage()
        for message in stub.GenerateStream(request, timeout=600, metadata=((CALLER_HEADER, caller),)):
            first, usage = first or time.perf_counter(), message.finish.usage
        return first, time.perf_counter(), usage

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(one, range(streams)))
    total = sum(usage.completion_tokens for *_, usage in done)
    return total / (max(end for _, end, _ in done) - min(first for first, _, _ in done)), done[0][2]


def llama_server_run(server: LlamaServer, prompt_ids: list[int], tokens: int, streams: int) -> float:
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda _: server.stream(prompt_ids, tokens), range(streams)))
    return sum(c.tokens for c in done) / (max(c.total_s for c in done) - min(c.ttft_s for c in done))


def median_ratio(top: list[float], bottom: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(top, bottom, strict=True))


def repetition(stub, plain: LlamaServer, speculating: LlamaServer, prompt: str, caller: str, tokens: int, streams: int,
               turn: int) -> tuple[dict[str, float], pb.Usage]:
    """The four sides' rates on one prompt, in turn (the order rotating with `turn`), and n-gram's usage."""
    ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat(prompt))).token_ids)  # the same tokens to llama-server
    usage = pb.Usage()

    def speculated() -> float:
        nonlocal usage
        rate, usage = tokenspout_run(stub, prompt, tokens, streams, NGRAM, caller + "-ngram")
        return rate

    sides: dict[str, Callable[[], float]] = {
        "off": lambda: tokenspout_run(stub, prompt, tokens, streams, OFF, caller + "-off")[0],
        "ngram": speculated,
        "llama-server": lambda: llama_server_run(plain, ids, tokens, streams),
        "llama-server spec": lambda: llama_server_run(speculating, ids, tokens, streams),
    }
    rates = {name: sides[name]() for name in rotated(list(sides), turn)}
    return rates, usage


def measure(run: Run, args: argparse.Namespace) -> None:
    concurrency = [int(n) for n in args.streams.split(",")]
    chosen = args.workloads.split(",")
    model = ("--model", str(args.model)) if args.model else ()
    figures: dict[str, dict[int, list]] = {}
    prose: list[float] = []
    json_ratios: list[float] = []
    with Sides() as sides:
        stub: pb_grpc.GenerationServiceStub = sides.tokenspout(*SERVER_FLAGS, *model, "--fairness-header", CALLER_HEADER).stub
        plain = sides.llama_server(args.llama_server, model=args.model)
        speculating = sides.llama_server(args.llama_server, *args.spec_args.split(), model=args.model)
        for name, prompts in WORKLOADS.items():
            for streams in concurrency if name in chosen else ():
                rates: dict[str, list[float]] = {}
                accepted = checked = 0
                for rep in range(args.reps):
                    rated, usage = repetition(stub, plain, speculating, prompts[rep % len(prompts)], f"{name}-{streams}-{rep}",
                                              args.tokens, streams, rep)
                    for side, rate in rated.items():
                        rates.setdefault(side, []).append(rate)
                    accepted, checked = accepted + usage.accepted_draft_tokens, checked + usage.draft_tokens
                ratio = {(top, bottom): median_ratio(rates[top], rates[bottom]) for top, bottom in
                         (("ngram", "off"), ("ngram", "llama-server spec"), ("llama-server spec", "llama-server"))}
                row = [*(round(value, 2) for value in ratio.values()), f"{accepted} of {checked}"]
                figures.setdefault(name, {})[streams] = row
                for workload, n, top, bottom, bound in TARGETS:
                    if (workload, n) == (name, streams):
                        run.target(f"{name}, {n} stream{'s' * (n > 1)}: {top} / {bottom}", ratio[top, bottom], ">=", bound)
                if name == "prose":
                    prose.append(ratio["ngram", "off"])
        for streams in concurrency if "json" in chosen else ():
            rates = {"free": [], "json": []}
            for rep in range(args.reps):
                prompt, caller = JSON_PROMPTS[rep % len(JSON_PROMPTS)], f"json-{streams}-{rep}"
                for constrained in rotated([False, True], rep):
                    rates["json" if constrained else "free"].append(
                        tokenspout_run(stub, prompt, args.json_tokens, streams, NGRAM, f"{caller}-{constrained}", constrained)[0])
            json_ratios.append(median_ratio(rates["json"], rates["free"]))
    if prose:
        run.target("prose: ngram / off, the lower over the stream counts", min(prose), ">=", 0.97)
    if json_ratios:
        run.target("JSON: constrained / unconstrained, the lower over the stream counts", min(json_ratios), ">=", 1.3)
    measures = ("n-gram / off", "n-gram / llama-server spec", "llama-server spec / plain", "drafts accepted")
    if figures:
        run.table("", ["workload", *(f"{what}, {n}" for what in measures for n in concurrency)],
                  [[name, *(by[n][k] for k in range(len(measures)) for n in concurrency)] for name, by in figures.items()])
