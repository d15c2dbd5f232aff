"""Multi-turn chats and salted callers.
3 sessions of 6 turns at a time (4 slots), each turn resending its history (greedy, <= 32 tokens), on each side in turn;
reachable: what a session's own history could serve. Then salted callers (`cache_scope = caller`), 3 reps.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from bench.harness.llama_server import LlamaServer
from bench.harness.pairing import rotated, span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import THREADS, Sides
from bench.harness.streams import settle
from tests.harness.chat_sessions import QUESTIONS, system_prompt
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="Prefix cache and affinity",
    needs=("llama-server",),
    smoke=("--reps", "1", "--sessions", "1", "--turns", "2", "--tokens", "8", "--salted-rules", "8"),
    order=4,
)
CONTEXT, SLOTS = 2048, 4
KEYS = {"alice": "alice-bench-key", "bob": "bob-bench-key"}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32, help="most tokens per answer")
    parser.add_argument("--think-s", type=float, default=0.0, help="pause between an answer and the next turn "
                        "(0: at once, the worst case for prefix_cache_exact, which computes the answer again after it)")
    parser.add_argument("--app-words", type=int, default=0,
                        help="0: each session its own short system prompt; N: one of ~N words all sessions share")
    parser.add_argument("--salted-rules", type=int, default=40, help="length of the salted callers' prefix, in rules")


@dataclass
class Sessions:
    sent: int = 0
    cached: int = 0
    reachable: int = 0
    """What a cache holding every earlier prompt and answer could serve: each turn's previous prompt and answer."""
    ttft_by_turn: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))

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


def run_sessions(label: str, args: argparse.Namespace, stub, reference: LlamaServer | None) -> Sessions:
    """`args.sessions` concurrent sessions on tokenspout (`reference` None) or llama-server (the prompts
    rendered by tokenspout's Tokenize, so both see the same tokens)."""
    result = Sessions()

    def session(index: int) -> None:
        shared = app_prompt(label, args.app_words) + f"\nThis chat is about {index}."
        system = shared if args.app_words else system_prompt(label, index)
        turns: list[tuple[str, str]] = []
        before = 0  # the previous turn's prompt and answer tokens
        for number in range(args.turns):
            question = QUESTIONS[number % len(QUESTIONS)]
            chat = messages_of(system, turns, question)
            if reference is None:
                ttft, answer, usage = ours(stub, chat, args.tokens)
                sent, cached, answered = usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
            else:
                ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids)
                completion = reference.stream(ids, args.tokens, ignore_eos=False)
                ttft, answer = completion.ttft_s, completion.text
                sent, cached = completion.prompt_computed + completion.prompt_cached, completion.prompt_cached
                answered = completion.tokens
            result.sent += sent
            result.cached += cached
            result.reachable += min(sent, before)
            before = sent + answered
            result.ttft_by_turn[number + 1].append(ttft)
            turns.append((question, answer))
            time.sleep(args.think_s)

    with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
        list(pool.map(session, range(args.sessions)))
    return result


def chats(run: Run, args: argparse.Namespace, flags: tuple[str, ...]) -> list[list]:
    with Sides() as sides:
        stubs = {"tokenspout": sides.tokenspout(*flags).stub, "exact": sides.tokenspout(*flags, "--prefix-cache-exact").stub,
                 "baseline": sides.tokenspout(*flags, "--prefix-cache-generated", "false").stub}
        reference = sides.llama_server(args.llama_server, context=CONTEXT, slots=SLOTS)
        for stub in stubs.values():
            ours(stub, messages_of("Warm up.", [], "Hi"), 4)
        results: dict[str, list[Sessions]] = {name: [] for name in (*stubs, "llama-server")}
        for rep in range(args.reps):
            for name in rotated(list(results), rep):  # each on fresh sessions
                stub = stubs.get(name, stubs["tokenspout"])
                results[name].append(run_sessions(f"{name}-{rep}", args, stub, reference if name == "llama-server" else None))
                if name in stubs:
                    settle(stub)  # its answers computed again while idle would slow the next side
        retiled = stubs["exact"].GetServerStatus(pb.GetServerStatusRequest()).retiled_tokens_total
    by_turn = {name: {turn: statistics.median(t for r in runs for t in r.ttft_by_turn[turn]) for turn in range(1, args.turns + 1)}
               for name, runs in results.items()}
    last, theirs = args.turns, by_turn["llama-server"][args.turns]
    labels = {"tokenspout": "tokenspout (reuse to the token, the default)", "exact": "tokenspout, `prefix_cache_exact`",
              "baseline": "baseline", "llama-server": "llama-server"}
    labels["exact"] += f" ({retiled:,} answer tokens computed again)"
    rows = []
    for name, runs in results.items():
        shares, ttfts = [r.share for r in runs], [t for r in runs for t in r.ttft_by_turn[last]]
        reachable = statistics.median(r.reachable_share for r in runs)
        rows.append([labels[name], f"{statistics.median(shares):.3f} ({reachable:.3f})",
                     f"{statistics.median(ttfts) * 1000:,.0f} ({min(ttfts) * 1000:,.0f}-{max(ttfts) * 1000:,.0f})",
                     round(by_turn[name][last] / theirs, 2) if name in ("tokenspout", "exact") else None])
        if name == "tokenspout":
            run.target("tokenspout's cache share / what each session's history could serve",
                       statistics.median(shares) / reachable, ">=", 0.9)
    run.target(f"turn-{last} first token, tokenspout / llama-server", by_turn["tokenspout"][last] / theirs, "<=", 1.0)
    run.plot("First token by turn (median over sessions and reps)", "turn", "first token, ms", {
        name: [(turn, ms * 1000) for turn, ms in by_turn[name].items()] for name in ("tokenspout", "llama-server")})
    return rows


def salted_callers(stub, rep: int, rules: int) -> tuple[float, float, float, list[int]]:
    """(B on A's prefix, B cold, A's own again) first tokens, and their cached tokens."""
    def key(name: str):
        return (("authorization", f"Bearer {KEYS[name]}"),)

    def prefix(tag: str) -> str:
        return " ".join(f"Rule {i} of shop {tag}: aisle {i % 17} holds item group {i * 7 % 31}." for i in range(rules))

    shared, fresh = prefix(f"{rep}-shared"), prefix(f"{rep}-fresh")
    ours(stub, messages_of(shared, [], "Where are the hammers?"), 4, key("alice"))  # A's prefix, now cached for A
    runs = {}
    for name in rotated(["on-a", "cold"], rep):
        runs[name] = ours(stub, messages_of(shared if name == "on-a" else fresh, [], "Do you sell paint?"), 4, key("bob"))
    runs["own"] = ours(stub, messages_of(shared, [], "Is there parking?"), 4, key("alice"))
    return (runs["on-a"][0], runs["cold"][0], runs["own"][0], [runs[n][2].cached_tokens for n in ("on-a", "cold", "own")])


def salted(run: Run, args: argparse.Namespace, flags: tuple[str, ...]) -> list:
    """Caller B's first token on caller A's prefix, on a cold one, and A's on its own: the table's row."""
    keys = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())
    with Sides() as sides:
        stub = sides.tokenspout(*flags, env={"TOKENSPOUT_API_KEYS": keys, "TOKENSPOUT_CACHE_SCOPE": "caller"}).stub
        found = [salted_callers(stub, rep, args.salted_rules) for rep in range(args.reps + 1)][1:]  # the first warms up
    on_a, cold, own = ([row[i] for row in found] for i in range(3))
    cached = [row[3] for row in found]
    ratio = statistics.median(on_a) / statistics.median(cold)
    row = ["salted callers (cached tokens; first token): B on A's prefix / B cold / A's own again",
           " / ".join(span([c[i] for c in cached], 0) for i in range(3)),
           " / ".join(f"{statistics.median(t) * 1000:,.0f}" for t in (on_a, cold, own)), None]
    run.target("salted: B's first token on A's prefix / B cold (no reuse across callers)", ratio, ">=", 0.9)
    return row


def measure(run: Run, args: argparse.Namespace) -> None:
    flags = ("--context-length", str(CONTEXT), "--max-batch-size", str(SLOTS), "--threads", str(THREADS))
    rows = chats(run, args, flags)
    run.table("", ["side", "cache share (reachable)", f"turn-{args.turns} first token, ms median (range)", "/ llama-server"],
              [*rows, salted(run, args, flags)])
