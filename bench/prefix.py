"""Prefix reuse: tokenspout against llama.cpp's own llama-server, every figure from one run.

Both serve the embedded model with the same slots and threads; each workload alternates the two
servers, rep by rep, so machine noise hits both alike. Every rep uses a fresh system prompt, so no rep
finds the previous one's cache. Prints:

  1. shared system prompt (~1,380 tokens), time to first token of requests 2-6, medians:
     a. one after another, b. all five at once (llama-server reuses a prefix only within a slot)
     target: tokenspout <= 0.5x llama-server
  2. an 8-turn chat, each turn resending the history: prompt tokens computed / prompt tokens sent
     target: <= 0.2 (i.e. <= 0.2x the tokens computed without reuse)

    python -m bench.prefix --llama-server PATH [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import statistics
import sys
import time

import grpc

from backend.common.models import default_model_path
from bench.llama_server import LlamaServer, start_llama_server
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

CONTEXT, SLOTS = 2048, 8
QUESTIONS = ["Where are the hammers?", "Do you sell blue paint?", "What saw cuts timber best?",
             "Can I return a drill?", "Is there parking?", "Do you cut keys?", "When do you open?",
             "Do you deliver?"]


def system_prompt(shop: int, target_tokens: int, stub) -> str:
    """A long, varied system prompt of about `target_tokens` tokens, unique to `shop`."""
    rules = []
    while True:
        i = len(rules)
        rules.append(f"Rule {i} of shop {shop}: when a customer asks about aisle {i % 17}, explain politely "
                     f"that item group {i * 7 % 31} is stocked there, and mention the {['morning', 'noon', 'evening'][i % 3]} "
                     f"opening hours.")
        text = "You are the assistant of a hardware shop.\n" + "\n".join(rules)
        if stub.Tokenize(pb.TokenizeRequest(text=text)).count >= target_tokens:
            return text


def chat(system: str, turns: list[tuple[str, str]], question: str) -> pb.Chat:
    messages = [pb.ChatMessage(role="system", content=system)]
    for asked, answer in turns:
        messages += [pb.ChatMessage(role="user", content=asked), pb.ChatMessage(role="assistant", content=answer)]
    return pb.Chat(messages=messages + [pb.ChatMessage(role="user", content=question)])


def ours(stub, conversation: pb.Chat, tokens: int) -> tuple[float, pb.GenerateStreamResponse, str]:
    """(seconds to the first token, the last message, the text) of one greedy chat stream."""
    request = pb.GenerateStreamRequest(chat=conversation, sampling=pb.SamplingParams(temperature=0.0),
                                       stopping=pb.StoppingCriteria(max_new_tokens=tokens))
    start = time.perf_counter()
    first = None
    text = []
    for message in stub.GenerateStream(request, timeout=300):
        if message.generated_tokens and first is None:
            first = time.perf_counter()
        text.append(message.text)
    return first - start, message, "".join(text)


def shared_prompt_ttft(stub, server: LlamaServer | None, rep: int, at_once: bool) -> tuple[list[float], list[float]]:
    """TTFT of requests 2-6 after request 1 warmed the shared system prompt, for each server."""
    system = system_prompt(1000 + rep * 2 + at_once, 1380, stub)
    conversations = [chat(system, [], q) for q in QUESTIONS[:6]]
    token_lists = [list(stub.Tokenize(pb.TokenizeRequest(chat=c)).token_ids) for c in conversations]

    def run(first, rest) -> list[float]:
        first(0)
        if at_once:
            with concurrent.futures.ThreadPoolExecutor(5) as pool:
                return list(pool.map(rest, range(1, 6)))
        return [rest(i) for i in range(1, 6)]

    our_ttft = run(lambda i: ours(stub, conversations[i], 8), lambda i: ours(stub, conversations[i], 8)[0])
    their_ttft = []
    if server is not None:
        their_ttft = run(lambda i: server.stream(token_lists[i], 8), lambda i: server.stream(token_lists[i], 8).ttft_s)
    return our_ttft, their_ttft


def multi_turn(stub, server: LlamaServer | None, rep: int) -> tuple[int, int, int, int]:
    """An 8-turn chat: (prompt tokens sent, computed) for tokenspout, then the same for llama-server."""
    system = system_prompt(2000 + rep, 300, stub)
    turns: list[tuple[str, str]] = []
    sent = computed = their_sent = their_computed = 0
    for question in QUESTIONS:
        conversation = chat(system, turns, question)
        _, last, answer = ours(stub, conversation, 48)
        usage = last.finish.usage
        sent += usage.prompt_tokens
        computed += usage.prompt_tokens - usage.cached_tokens
        if server is not None:
            token_ids = list(stub.Tokenize(pb.TokenizeRequest(chat=conversation)).token_ids)
            completion = server.stream(token_ids, 48, ignore_eos=False)
            their_sent += completion.prompt_computed + completion.prompt_cached
            their_computed += completion.prompt_computed
        turns.append((question, answer))
    return sent, computed, their_sent, their_computed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server binary, for the reference")
    args = parser.parse_args()
    model = default_model_path()
    print(f"model {model.name}, {args.threads} threads, {SLOTS} slots, context {CONTEXT}, {os.cpu_count()} cores")
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    server = start_server(tmp, "--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS),
                          "--threads", str(args.threads))
    reference = start_llama_server(args.llama_server, model, CONTEXT, SLOTS, args.threads) if args.llama_server else None
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            ours(stub, chat("Warm up.", [], "Hi"), 4)
            for at_once in (False, True):
                mine, theirs = [], []
                for rep in range(args.reps):
                    a, b = shared_prompt_ttft(stub, reference, rep, at_once)
                    mine += a
                    theirs += b
                label = "all five at once" if at_once else "one after another"
                line = f"shared system prompt, requests 2-6 {label}: tokenspout TTFT {statistics.median(mine) * 1000:.0f} ms"
                if theirs:
                    ratio = statistics.median(mine) / statistics.median(theirs)
                    line += f", llama-server {statistics.median(theirs) * 1000:.0f} ms, ratio {ratio:.2f} (target <= 0.5)"
                print(line)
            totals = [0, 0, 0, 0]
            for rep in range(args.reps):
                totals = [t + v for t, v in zip(totals, multi_turn(stub, reference, rep))]
            sent, computed, their_sent, their_computed = totals
            line = (f"8-turn chat: tokenspout computed {computed} of {sent} prompt tokens, {computed / sent:.3f} "
                    f"of what it would without reuse (target <= 0.2)")
            if their_sent:
                line += f"; llama-server computed {their_computed} of {their_sent}, {their_computed / their_sent:.3f}"
            print(line)
            status = stub.GetServerStatus(pb.GetServerStatusRequest())
            print(f"server: {status.cached_prefixes} cached prefixes ({status.cached_prefix_tokens} tokens), "
                  f"hit rate {status.prefix_cache_hit_rate:.3f}")
    finally:
        if reference is not None:
            reference.stop()
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
