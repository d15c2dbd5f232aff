"""Speculative decoding: tokenspout with and without against llama.cpp's llama-server with and without,
every figure from one run.

One tokenspout server (its speculation chosen per request: off, or n-gram with the planner deciding
each step whether checking pays) and two llama-servers (plain, and the n-gram speculation given by
--spec-args), same GGUF, slots and threads. Each repetition sends every server the same new prompt
(bench/workloads.py), the four in turn, so machine noise hits them alike and no pool of n-grams kept
across requests has seen the text before (tokenspout's is per caller: each of its runs is a caller of
its own). Every prompt is the same token ids for both servers (tokenspout renders the chat;
llama-server gets its tokens). Decode tokens/s is counted from each stream's first token to the last
token of all of them; ratios are medians of each repetition's ratio.

  workloads  copy (a 150-token passage, word for word), edit (a function, one name changed), quote
             (an answer quoting its input), prose (free writing), json (a key-heavy schema, tokenspout
             constrained against the same prompt unconstrained)
  targets    copy, 1 stream: ngram >= 1.3x off and >= 1.1x llama-server's best; copy, 8 streams:
             ngram >= 1.0x off; prose: ngram >= 0.97x off at 1 and 8; json: constrained /
             unconstrained >= 1.3 at 1 and 8
  also       greedy output with speculation on against off, for every workload and rep

    python -m bench.speculation --llama-server PATH [--reps 5] [--threads 2] [--tokens 120] [--model GGUF]

  --model  another GGUF for both servers (default: the embedded model)
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
from bench.llama_server import start_llama_server
from bench.workloads import WORKLOADS
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

CONTEXT, SLOTS = 1024, 8
CALLER_HEADER = "x-bench-caller"
# The best of 10 settings on these workloads (docs/benchmarks.md).
BEST_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"
# Integers bounded, as real schemas bound them: unbounded, the embedded model wrote 100-digit numbers in
# most runs, so the workload measured a digit loop, not keys (docs/benchmarks.md).
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


def chat(prompt: str) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=prompt)])


def tokenspout_run(stub, prompt: str, tokens: int, streams: int, mode: int, caller: str, constrained: bool = False):
    """(decode tok/s over all streams, the first stream's text, its usage)."""
    request = pb.GenerateStreamRequest(
        chat=chat(prompt), sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=not constrained),
        speculation=pb.Speculation(mode=mode),
    )
    if constrained:
        request.constraint.json_schema = json.dumps(KEY_HEAVY_SCHEMA)

    def one(_):
        first = None
        text = []
        for message in stub.GenerateStream(request, timeout=600, metadata=((CALLER_HEADER, caller),)):
            first = first or time.perf_counter()
            text.append(message.text)
        return first, time.perf_counter(), "".join(text), message.finish.usage

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    total = sum(usage.completion_tokens for *_, usage in results)
    return total / (max(r[1] for r in results) - min(r[0] for r in results)), results[0][2], results[0][3]


def llama_server_run(server, prompt_ids: list[int], tokens: int, streams: int) -> float:
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        start = time.perf_counter()
        done = list(pool.map(lambda _: server.stream(prompt_ids, tokens), range(streams)))
    firsts = [start + c.ttft_s for c in done]
    return sum(c.tokens for c in done) / (start + max(c.total_s for c in done) - min(firsts))


def median_ratio(top: list[float], bottom: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(top, bottom))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--spec-args", default=BEST_SPEC, help="llama-server's speculation flags")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--workloads", default=",".join([*WORKLOADS, "json"]))
    parser.add_argument("--model", type=pathlib.Path, default=None)
    args = parser.parse_args()
    model = args.model or default_model_path()
    concurrency = [int(n) for n in args.streams.split(",")]
    chosen = args.workloads.split(",")
    print(f"model {model.name}, {args.threads} threads, {SLOTS} slots, {args.tokens} tokens, {os.cpu_count()} cores, "
          f"{args.reps} reps, llama-server speculation: {args.spec_args}")
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    ours = start_server(tmp, "--model", str(model), "--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS),
                        "--threads", str(args.threads), "--fairness-header", CALLER_HEADER)
    plain = start_llama_server(args.llama_server, model, CONTEXT, SLOTS, args.threads)
    speculating = start_llama_server(args.llama_server, model, CONTEXT, SLOTS, args.threads, args.spec_args.split())
    off, ngram = pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_NGRAM
    same_output = differing = 0
    try:
        with grpc.insecure_channel(ours.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            for name, prompts in WORKLOADS.items():
                if name not in chosen:
                    continue
                for streams in concurrency:
                    rates = {key: [] for key in ("off", "ngram", "ls", "ls-spec")}
                    accepted = proposed = 0
                    for rep in range(args.reps):
                        prompt = prompts[rep % len(prompts)]
                        ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat(prompt))).token_ids)
                        caller = f"{name}-{streams}-{rep}"
                        rate_off, text_off, _ = tokenspout_run(stub, prompt, args.tokens, streams, off, caller + "-off")
                        rate_on, text_on, usage = tokenspout_run(stub, prompt, args.tokens, streams, ngram, caller + "-on")
                        rates["off"].append(rate_off)
                        rates["ngram"].append(rate_on)
                        rates["ls"].append(llama_server_run(plain, ids, args.tokens, streams))
                        rates["ls-spec"].append(llama_server_run(speculating, ids, args.tokens, streams))
                        accepted, proposed = accepted + usage.accepted_draft_tokens, proposed + usage.draft_tokens
                        same_output += text_on == text_off
                        differing += text_on != text_off
                    m = {key: statistics.median(values) for key, values in rates.items()}
                    print(f"{name:<6} {streams} streams: tokenspout off {m['off']:6.1f}  ngram {m['ngram']:6.1f} "
                          f"({median_ratio(rates['ngram'], rates['off']):.2f}x off, "
                          f"{median_ratio(rates['ngram'], rates['ls-spec']):.2f}x llama-server's spec, "
                          f"{median_ratio(rates['ngram'], rates['ls']):.2f}x its plain) | "
                          f"llama-server {m['ls']:6.1f}  spec {m['ls-spec']:6.1f} "
                          f"({median_ratio(rates['ls-spec'], rates['ls']):.2f}x) | "
                          f"drafts {accepted}/{proposed} accepted (first stream)", flush=True)
            if "json" in chosen:
                for streams in concurrency:
                    free, constrained = [], []
                    accepted = proposed = 0
                    for rep in range(args.reps):
                        prompt = JSON_PROMPTS[rep % len(JSON_PROMPTS)]
                        caller = f"json-{streams}-{rep}"
                        free.append(tokenspout_run(stub, prompt, 200, streams, ngram, caller + "-free")[0])
                        rate, _, usage = tokenspout_run(stub, prompt, 200, streams, ngram, caller + "-json", constrained=True)
                        constrained.append(rate)
                        accepted, proposed = accepted + usage.accepted_draft_tokens, proposed + usage.draft_tokens
                    print(f"json   {streams} streams: constrained {statistics.median(constrained):6.1f}, unconstrained "
                          f"{statistics.median(free):6.1f} = {median_ratio(constrained, free):.2f} "
                          f"(drafts {accepted}/{proposed} accepted, first stream)", flush=True)
            status = stub.GetServerStatus(pb.GetServerStatusRequest())
            print(f"greedy output with speculation on = off in {same_output} of {same_output + differing} runs; "
                  f"server drafts {status.accepted_draft_tokens_total}/{status.draft_tokens_total} accepted")
    finally:
        plain.stop()
        speculating.stop()
        stop_server(ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
