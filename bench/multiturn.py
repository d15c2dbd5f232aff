"""Chats that go on, and callers kept apart (issue 37): every figure from one run.

1. Chat sessions of 6 turns on one replica, each turn resending its history and the answers it got
   (greedy, stopping at the model's end of turn or `--tokens`), a few sessions at a time. For
   tokenspout (answers' cells reused to the token as they were decoded, as llama-server does),
   tokenspout with prefix_cache_exact (answers computed again as prompt rows, greedy output a cold
   run's), the baseline tokenspout (prefix_cache_generated = false, prompts' cells only) and
   llama-server (its slots keep generated tokens), alternating rep by rep, each on fresh sessions:
   - cache share: prompt tokens served from cache / prompt tokens sent (target >= 0.9);
   - turn-6 time to first token, median, tokenspout / llama-server (target <= 1).
   `--think-s` waits that long between a turn's answer and the next turn (0: at once, the worst
   case for prefix_cache_exact, whose engine computes the answer again as prompt rows after it).
2. Salted callers (cache_scope = caller, two API keys), per rep on a fresh system prompt: caller B's
   TTFT on caller A's prefix, B's on a prefix no one sent (cold), and A's on its own prefix again.
   Targets: B on A's / B cold ~ 1 (no reuse), A's own clearly below.

    python -m bench.multiturn --llama-server PATH [--reps 3] [--sessions 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass, field

import grpc

from backend.common.models import default_model_path
from bench.common import settle
from bench.llama_server import LlamaServer, start_llama_server
from tests.harness.chat_sessions import QUESTIONS, system_prompt
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

CONTEXT, SLOTS, TURNS = 2048, 4, 6
KEYS = {"alice": "alice-bench-key", "bob": "bob-bench-key"}


@dataclass
class Sessions:
    sent: int = 0
    cached: int = 0
    reachable: int = 0
    """What a cache holding every earlier prompt and answer could serve: each turn's previous prompt and answer."""
    last_turn_ttft: list[float] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.cached / max(1, self.sent)

    @property
    def reachable_share(self) -> float:
        return self.reachable / max(1, self.sent)


def messages_of(system: str, turns: list[tuple[str, str]], question: str) -> pb.Chat:
    messages = [pb.ChatMessage(role="system", content=system)]
    for asked, answer in turns:
        messages += [pb.ChatMessage(role="user", content=asked), pb.ChatMessage(role="assistant", content=answer)]
    return pb.Chat(messages=[*messages, pb.ChatMessage(role="user", content=question)])


def ours(stub, chat: pb.Chat, tokens: int, metadata=()) -> tuple[float, str, pb.Usage]:
    request = pb.GenerateStreamRequest(chat=chat, sampling=pb.SamplingParams(temperature=0.0),
                                       stopping=pb.StoppingCriteria(max_new_tokens=tokens))
    start, first, text = time.perf_counter(), 0.0, []
    for message in stub.GenerateStream(request, timeout=300, metadata=metadata):
        first = first or time.perf_counter() - start
        text.append(message.text)
    return first, "".join(text), message.finish.usage


def app_prompt(label: str, words: int) -> str:
    """One system prompt that every session of a run shares (an app's), about `words` words."""
    rules = [f"Rule {i}: when asked about topic {i % 13}, answer plainly and mention shelf {i * 7 % 31}."
             for i in range(max(1, words // 14))]
    return f"[{label}] You are a patient guide. Answer in one short sentence.\n" + "\n".join(rules)


def run_sessions(label: str, count: int, tokens: int, think_s: float, stub, reference: LlamaServer | None,
                 app_words: int = 0) -> Sessions:
    """`count` concurrent sessions of TURNS turns on tokenspout (`reference` None) or llama-server
    (the prompts rendered by tokenspout's Tokenize, so both see the same tokens); each with a system
    prompt of its own (tests/harness/chat_sessions), or with `app_words`, one they share."""
    result = Sessions()

    def session(index: int) -> None:
        system = app_prompt(label, app_words) + f"\nThis chat is about {index}." if app_words else system_prompt(label, index)
        turns: list[tuple[str, str]] = []
        before = 0  # the previous turn's prompt and answer tokens
        for number in range(TURNS):
            question = QUESTIONS[number % len(QUESTIONS)]
            chat = messages_of(system, turns, question)
            if reference is None:
                ttft, answer, usage = ours(stub, chat, tokens)
                sent, cached, answered = usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
            else:
                ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids)
                completion = reference.stream(ids, tokens, ignore_eos=False)
                ttft, answer = completion.ttft_s, completion.text
                sent, cached = completion.prompt_computed + completion.prompt_cached, completion.prompt_cached
                answered = completion.tokens
            result.sent += sent
            result.cached += cached
            result.reachable += min(sent, before)
            before = sent + answered
            if number == TURNS - 1:
                result.last_turn_ttft.append(ttft)
            turns.append((question, answer))
            time.sleep(think_s)

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        list(pool.map(session, range(count)))
    return result


def salted_callers(stub, rep: int) -> tuple[float, float, float, list[int]]:
    """(B on A's prefix, B cold, A's own again) TTFTs, and their cached tokens."""
    def key(name: str):
        return (("authorization", f"Bearer {KEYS[name]}"),)

    def prefix(tag: str) -> str:
        return " ".join(f"Rule {i} of shop {tag}: aisle {i % 17} holds item group {i * 7 % 31}." for i in range(40))

    shared, fresh = prefix(f"{rep}-shared"), prefix(f"{rep}-fresh")
    ours(stub, messages_of(shared, [], "Where are the hammers?"), 4, key("alice"))  # A's prefix, now cached for A
    runs = {}
    order = ["on-a", "cold"] if rep % 2 == 0 else ["cold", "on-a"]
    for name in order:
        system = shared if name == "on-a" else fresh
        runs[name] = ours(stub, messages_of(system, [], "Do you sell paint?"), 4, key("bob"))
    runs["own"] = ours(stub, messages_of(shared, [], "Is there parking?"), 4, key("alice"))
    return (runs["on-a"][0], runs["cold"][0], runs["own"][0],
            [runs[n][2].cached_tokens for n in ("on-a", "cold", "own")])


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:.0f} ms (range {min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="most tokens per answer")
    parser.add_argument("--think-s", type=float, default=0.0)
    parser.add_argument("--app-words", type=int, default=0,
                        help="0: each session its own short system prompt; N: one of ~N words all sessions share")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server binary, for the reference")
    args = parser.parse_args()
    model = default_model_path()
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    flags = ("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(args.threads))
    print(f"model {model.name}, {args.threads} threads, {SLOTS} slots (+2 prefix streams), {args.sessions} sessions "
          f"x {TURNS} turns at a time, answers <= {args.tokens} tokens, think {args.think_s:g} s, "
          f"system prompt {f'shared, ~{args.app_words} words' if args.app_words else 'per session'}, "
          f"{os.cpu_count()} cores")
    servers = {"tokenspout": start_server(tmp, *flags),
               "exact": start_server(tmp, *flags, "--prefix-cache-exact"),
               "baseline": start_server(tmp, *flags, "--prefix-cache-generated", "false")}
    reference = start_llama_server(args.llama_server, model, CONTEXT, SLOTS, args.threads) if args.llama_server else None
    results: dict[str, list[Sessions]] = {name: [] for name in (*servers, "llama-server")}
    try:
        channels = {name: grpc.insecure_channel(server.address) for name, server in servers.items()}
        stubs = {name: pb_grpc.GenerationServiceStub(channel) for name, channel in channels.items()}
        for stub in stubs.values():
            ours(stub, messages_of("Warm up.", [], "Hi"), 4)
        for rep in range(args.reps):
            sides = [*stubs, *(["llama-server"] if reference else [])]
            for name in sides if rep % 2 == 0 else reversed(sides):
                stub = stubs.get(name, stubs["tokenspout"])
                ref = reference if name == "llama-server" else None
                results[name].append(run_sessions(f"{name}-{rep}", args.sessions, args.tokens, args.think_s, stub, ref,
                                                  args.app_words))
                if ref is None:
                    settle(stub)  # its answers computed again while idle would slow the next side
        for name, runs in results.items():
            if runs:
                shares = [r.share for r in runs]
                ttfts = [t for r in runs for t in r.last_turn_ttft]
                print(f"{name}: cache share {statistics.median(shares):.3f} (range {min(shares):.3f}-{max(shares):.3f}; "
                      f"reachable {statistics.median(r.reachable_share for r in runs):.3f}), turn-6 TTFT {ms(ttfts)}")
        if reference:
            theirs = statistics.median(t for r in results["llama-server"] for t in r.last_turn_ttft)
            for name in ("tokenspout", "exact"):
                mine = statistics.median(t for r in results[name] for t in r.last_turn_ttft)
                print(f"turn-6 TTFT {name} / llama-server: {mine / theirs:.2f} (target <= 1)")
        status = stubs["exact"].GetServerStatus(pb.GetServerStatusRequest())
        print(f"exact: {status.retiled_tokens_total} tokens computed again as prompt rows after their turn")
        for channel in channels.values():
            channel.close()
    finally:
        if reference is not None:
            reference.stop()
        for server in servers.values():
            stop_server(server)
    salted(tmp, flags, args.reps)
    return 0


def salted(tmp: pathlib.Path, flags: tuple[str, ...], reps: int) -> None:
    keys = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())
    server = start_server(tmp, *flags, env={"TOKENSPOUT_API_KEYS": keys, "TOKENSPOUT_CACHE_SCOPE": "caller"})
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            rows = [salted_callers(stub, rep) for rep in range(reps + 1)][1:]  # the first warms up
        on_a, cold, own = ([row[i] for row in rows] for i in range(3))
        print(f"salted callers (cache_scope = caller): B on A's prefix {ms(on_a)}, B cold {ms(cold)}, "
              f"A's own again {ms(own)}; cached tokens (B on A's, B cold, A own) {[row[3] for row in rows]}")
        print(f"  B on A's / B cold {statistics.median(on_a) / statistics.median(cold):.2f} (target ~1), "
              f"A's own / B cold {statistics.median(own) / statistics.median(cold):.2f}")
    finally:
        stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
