"""Prefix reuse against llama-server.
Both servers in turn, each rep on a fresh ~1,380-token system prompt: five new questions after it, one after another
and all at once (llama-server reuses a prefix only within a slot); an 8-turn chat resending its history.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

from bench.harness.llama_server import LlamaServer
from bench.harness.record import Benchmark, Run
from bench.harness.sides import SLOTS, THREADS, Sides
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="Prefix cache and affinity",
    needs=("llama-server",),
    smoke=("--reps", "1", "--system-tokens", "200", "--turns", "3", "--answer-tokens", "8"),
    order=1,
)
CONTEXT = 2048
QUESTIONS = ["Where are the hammers?", "Do you sell blue paint?", "What saw cuts timber best?",
             "Can I return a drill?", "Is there parking?", "Do you cut keys?", "When do you open?",
             "Do you deliver?"]


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1380, help="the shared system prompt's length")
    parser.add_argument("--turns", type=int, default=8, help="turns of the chat")
    parser.add_argument("--answer-tokens", type=int, default=48, help="most tokens of a chat's answer")


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
    assert first is not None
    return first - start, message, "".join(text)


def shared_prompt_ttft(stub, server: LlamaServer | None, rep: int, at_once: bool,
                       system_tokens: int = 1380) -> tuple[list[float], list[float]]:
    """TTFT of requests 2-6 after request 1 warmed the shared system prompt, for each server (tokenspout first)."""
    system = system_prompt(1000 + rep * 2 + at_once, system_tokens, stub)
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


def multi_turn(stub, server: LlamaServer | None, rep: int, turns_count: int = 8,
               answer_tokens: int = 48) -> tuple[int, int, int, int]:
    """A chat of `turns_count` turns: (prompt tokens sent, computed) for tokenspout, then the same for llama-server."""
    system = system_prompt(2000 + rep, 300, stub)
    turns: list[tuple[str, str]] = []
    sent = computed = their_sent = their_computed = 0
    for question in (QUESTIONS * 2)[:turns_count]:
        conversation = chat(system, turns, question)
        _, last, answer = ours(stub, conversation, answer_tokens)
        usage = last.finish.usage
        sent += usage.prompt_tokens
        computed += usage.prompt_tokens - usage.cached_tokens
        if server is not None:
            token_ids = list(stub.Tokenize(pb.TokenizeRequest(chat=conversation)).token_ids)
            completion = server.stream(token_ids, answer_tokens, ignore_eos=False)
            their_sent += completion.prompt_computed + completion.prompt_cached
            their_computed += completion.prompt_computed
        turns.append((question, answer))
    return sent, computed, their_sent, their_computed


def measure(run: Run, args: argparse.Namespace) -> None:
    with Sides() as sides:
        stub = sides.tokenspout("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS),
                                "--threads", str(THREADS)).stub
        reference = sides.llama_server(args.llama_server, context=CONTEXT)
        ours(stub, chat("Warm up.", [], "Hi"), 4)
        reference.stream("Warm up.", 4)
        rows: list[list] = []
        for at_once in (False, True):
            mine: list[float] = []
            theirs: list[float] = []
            for rep in range(args.reps):  # each rep sends to tokenspout then llama-server, on a fresh prompt
                a, b = shared_prompt_ttft(stub, reference, rep, at_once, args.system_tokens)
                mine += a
                theirs += b
            ratio = statistics.median(mine) / statistics.median(theirs)
            label = "all five at once" if at_once else "one after another"
            rows.append([f"shared system prompt, requests 2-6 {label}, first token median, ms",
                         round(statistics.median(mine) * 1000), round(statistics.median(theirs) * 1000), round(ratio, 3)])
            run.target(f"first token of requests 2-6 {label}, tokenspout / llama-server", ratio, "<=", 0.5)
        totals = [0, 0, 0, 0]
        for rep in range(args.reps):
            totals = [t + v for t, v in zip(totals, multi_turn(stub, reference, rep, args.turns, args.answer_tokens))]
        sent, computed, their_sent, their_computed = totals
        rows.append([f"{args.turns}-turn chat, prompt tokens computed / sent", f"{computed / sent:.3f} ({computed:,} / {sent:,})",
                     f"{their_computed / their_sent:.3f} ({their_computed:,} / {their_sent:,})", None])
    run.table("", ["workload", "tokenspout", "llama-server", "ratio"], rows)
    run.target(f"{args.turns}-turn chat, prompt tokens tokenspout computed / sent", computed / sent, "<=", 0.2)
