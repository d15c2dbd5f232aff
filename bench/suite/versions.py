"""This checkout against an older one (`--against`: a directory, or a git ref in a temporary worktree).
Same flags, alternating: decode at 1 and 8 streams, server CPU per token, first token, requests 2-6 on a shared system
prompt (in turn, at once), a chat's computed / sent, a fresh server's start; new/old: the median ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import subprocess
import time

from bench.harness.pairing import rotated
from bench.harness.record import ROOT, Benchmark, Run
from bench.harness.sides import THREADS, Sides
from bench.harness.streams import aggregate_rate, cpu_seconds, greedy_request, timed_stream
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="Against an older version",
    smoke=("--against", "HEAD", "--reps", "1", "--tokens", "8", "--streams", "2", "--questions", "1", "--turns", "2",
           "--answer-tokens", "8", "--shared-tokens", "100"),
)
QUESTIONS = ["Where are the hammers?", "Do you sell blue paint?", "What saw cuts timber best?", "Can I return a drill?",
             "Is there parking?", "Do you cut keys?", "When do you open?", "Do you deliver?"]
SERVING = {  # name: higher is better
    "decode 1 stream, tok/s": True, "decode n streams, tok/s": True, "server CPU per token, ms": False,
    "first token, ms": False, "shared prompt, one after another, ms": False, "shared prompt, at once, ms": False,
    "chat computed / sent": False,
}
FIGURES = SERVING | {"start, s": False, "start CPU, s": False}
TWO_DECIMALS = ("server CPU per token, ms", "chat computed / sent", "start, s", "start CPU, s")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", default="main", help="the older checkout: a directory, or a git ref")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--questions", type=int, default=8, help="short questions per rep for the first token")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams, decode's second figure")
    parser.add_argument("--turns", type=int, default=8, help="turns of the chat")
    parser.add_argument("--answer-tokens", type=int, default=48, help="most tokens of a chat's answer")
    parser.add_argument("--shared-tokens", type=int, default=1380, help="the shared system prompt's length")
    parser.add_argument("--speculation", default="off", help="the new server's speculation (an old one may not know it)")


def older_checkout(sides: Sides, against: str) -> pathlib.Path:
    if pathlib.Path(against).is_dir():
        return pathlib.Path(against).resolve()
    path = sides.tmp / "older"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), against], cwd=ROOT, check=True, capture_output=True)
    sides.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=True)
    return path


def system_prompt(shop: int, target_tokens: int, stub) -> str:
    """A long, varied system prompt of about `target_tokens` tokens, unique to `shop` (no rep finds another's)."""
    rules: list[str] = []
    while True:
        i = len(rules)
        rules.append(f"Rule {i} of shop {shop}: when a customer asks about aisle {i % 17}, explain politely that item "
                     f"group {i * 7 % 31} is stocked there, and mention the {['morning', 'noon', 'evening'][i % 3]} hours.")
        text = "You are the assistant of a hardware shop.\n" + "\n".join(rules)
        if stub.Tokenize(pb.TokenizeRequest(text=text)).count >= target_tokens:
            return text


def chat_stream(stub, system: str, turns: list[tuple[str, str]], question: str, tokens: int) -> tuple[float, pb.Usage, str]:
    """(seconds to the first token, the usage, the answer) of one greedy chat turn."""
    messages = [pb.ChatMessage(role="system", content=system)]
    for asked, answer in turns:
        messages += [pb.ChatMessage(role="user", content=asked), pb.ChatMessage(role="assistant", content=answer)]
    request = pb.GenerateStreamRequest(chat=pb.Chat(messages=[*messages, pb.ChatMessage(role="user", content=question)]),
                                       sampling=pb.SamplingParams(temperature=0.0),
                                       stopping=pb.StoppingCriteria(max_new_tokens=tokens))
    start, first, text = time.perf_counter(), None, []
    for message in stub.GenerateStream(request, timeout=300):
        if message.generated_tokens and first is None:
            first = time.perf_counter() - start
        text.append(message.text)
    return first or 0.0, message.finish.usage, "".join(text)


def first_token_s(stub, prompt: str) -> float:
    start, first = time.perf_counter(), None
    for _ in stub.GenerateStream(greedy_request(prompt, 4), timeout=300):
        first = first or time.perf_counter() - start
    return first or 0.0


def shared_prompt_ttft(stub, seed: int, tokens: int, at_once: bool) -> float:
    """Median first token of requests 2-6 once request 1 has computed their shared system prompt."""
    system = system_prompt(seed, tokens, stub)
    chat_stream(stub, system, [], QUESTIONS[0], 8)

    def ask(question: str) -> float:
        return chat_stream(stub, system, [], question, 8)[0]

    if at_once:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            return statistics.median(pool.map(ask, QUESTIONS[1:6]))
    return statistics.median(ask(question) for question in QUESTIONS[1:6])


def figures(served, rep: int, args: argparse.Namespace) -> dict[str, float]:
    cpu = cpu_seconds(served.pid)
    single = timed_stream(served.stub, "The history of the printing press", args.tokens)[1]
    many = aggregate_rate(served.stub, args.streams, args.tokens)
    cpu_ms = (cpu_seconds(served.pid) - cpu) / ((1 + args.streams) * args.tokens) * 1000
    ttft = statistics.median(first_token_s(served.stub, f"Question {rep}.{i}: why is the sky blue?")
                             for i in range(args.questions))
    system, turns, sent, computed = system_prompt(2000 + rep, 300, served.stub), [], 0, 0
    for question in (QUESTIONS * 2)[:args.turns]:
        _, usage, answer = chat_stream(served.stub, system, turns, question, args.answer_tokens)
        sent, computed = sent + usage.prompt_tokens, computed + usage.prompt_tokens - usage.cached_tokens
        turns.append((question, answer))
    return dict(zip(SERVING, (single, many, cpu_ms, ttft * 1000,
                              shared_prompt_ttft(served.stub, 1000 + 2 * rep, args.shared_tokens, False) * 1000,
                              shared_prompt_ttft(served.stub, 1001 + 2 * rep, args.shared_tokens, True) * 1000,
                              computed / sent), strict=True))


def start(tmp: pathlib.Path, root: pathlib.Path, flags: tuple[str, ...]) -> dict[str, float]:
    """A fresh server's start: seconds from `tokenspout serve` to its serving line, and its processes' CPU by then."""
    began = time.perf_counter()
    server = start_server(tmp, *flags, root=root)
    up = time.perf_counter() - began
    cpu = cpu_seconds(server.process.pid)
    stop_server(server)
    return {"start, s": up, "start CPU, s": cpu}


def measure(run: Run, args: argparse.Namespace) -> None:
    flags = ("--context-length", "2048", "--max-batch-size", "8", "--threads", str(args.threads))
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with Sides() as sides:
        roots = {"old": older_checkout(sides, args.against), "new": ROOT}
        servers = {"old": sides.tokenspout(*flags, root=roots["old"]),
                   "new": sides.tokenspout(*flags, "--speculation", args.speculation)}
        for served in servers.values():  # warm both
            chat_stream(served.stub, "Warm up.", [], "Hi", 4)
        for rep in range(args.reps):
            for name in rotated(list(servers), rep):
                results[name].append(figures(servers[name], rep, args) | start(sides.tmp, roots[name], flags))
    medians = {name: {f: statistics.median(r[f] for r in done) for f in FIGURES} for name, done in results.items()}
    ratios = {f: statistics.median(n[f] / o[f] for o, n in zip(results["old"], results["new"], strict=True)) for f in FIGURES}
    columns = [f"decode 1 / {args.streams} streams, tok/s", "server CPU per token, ms", "first token, ms",
               "shared prompt, one after another / at once, ms", "chat computed / sent", "start: up / CPU, s"]

    def row(name: str, values: dict[str, float], ratio: bool = False) -> list:
        cells = [f"{values[f]:.{2 if ratio or f in TWO_DECIMALS else 1}f}" for f in FIGURES]
        return [name, f"{cells[0]} / {cells[1]}", cells[2], cells[3], f"{cells[4]} / {cells[5]}", cells[6],
                f"{cells[7]} / {cells[8]}"]

    run.table("", ["", *columns], [row(f"old ({args.against})", medians["old"]), row("new", medians["new"]),
                                   row("new / old", ratios, ratio=True)])
    speeds = [ratio if FIGURES[f] else 1 / ratio for f, ratio in ratios.items()]
    run.target("the slowest figure, new against old (speed: new rate / old, old time / new)", min(speeds), ">=", 1.0)
