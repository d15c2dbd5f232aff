"""Greedy output with speculation and without.
44 prompts, 160 greedy tokens, speculation off and n-gram as served, alone and 8 at a time (`--prefix-cache-exact`).
"""

from __future__ import annotations

import argparse
import concurrent.futures

from bench.harness.pairing import span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import SERVER_FLAGS, Sides
from bench.harness.workloads import WORKLOADS
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(area="Speculative decoding", smoke=("--tokens", "8", "--prompts", "2", "--group", "2"), order=2)
QUESTIONS = [
    "Why is the sky blue?", "Explain photosynthesis to a child.", "Write a haiku about winter.",
    "What is the capital of France, and why is it famous?", "List five prime numbers and explain what a prime is.",
    "Give me a recipe for pancakes.", "Summarize the plot of Romeo and Juliet.", "How do vaccines work?",
    "Translate 'good morning, how are you?' into Spanish and French.", "What are the rules of chess for a pawn?",
    "Write a Python function that reverses a string.", "Describe the water cycle step by step.",
    "What is the difference between weather and climate?", "Tell me a joke about computers.",
    "How does a bicycle stay upright?", "Name three planets and one fact about each.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Count from one to twenty in words.", "Write the alphabet, one letter per line.",
    "Write a JSON object describing a book with title, author and year.",
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "What is machine learning?", "Write a short email asking for a day off.", "Explain what a CPU does.",
]


class Output:
    def __init__(self) -> None:
        self.prompt_tokens = self.checked = self.kept = 0
        self.ids: list[int] = []


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--prompts", type=int, default=0, help="the first N prompts only (0: all)")
    parser.add_argument("--group", type=int, default=8, help="prompts at a time in the second pass")


def generate(stub, text: str, tokens: int, mode: int) -> Output:
    request = pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
        speculation=pb.Speculation(mode=mode, max_draft_tokens=16),
        output=pb.OutputOptions(return_token_ids=True),
    )
    output = Output()
    for message in stub.GenerateStream(request, timeout=600):
        output.prompt_tokens = output.prompt_tokens or message.input_tokens
        output.ids += [token.id for token in message.tokens]
        if message.HasField("finish"):
            output.checked, output.kept = message.finish.usage.draft_tokens, message.finish.usage.accepted_draft_tokens
    return output


def outputs(stub, texts: list[str], tokens: int, mode: int, group: int) -> list[Output]:
    """Each prompt's output, `group` prompts at a time (sent together, so that they decode in the same steps)."""
    with concurrent.futures.ThreadPoolExecutor(group) as pool:
        return [out for start in range(0, len(texts), group)
                for out in pool.map(lambda text: generate(stub, text, tokens, mode), texts[start:start + group])]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compared(what: str, a: list[Output], b: list[Output], speculated: list[Output] | None) -> list:
    """A row: how many outputs differ, the proposed tokens checked and kept, where (cache positions) the first differ."""
    where = [x.prompt_tokens + first_difference(x.ids, y.ids) for x, y in zip(a, b, strict=True) if x.ids != y.ids]
    checked, kept = (sum(o.checked for o in speculated), sum(o.kept for o in speculated)) if speculated else (None, None)
    return [what, f"{len(where)} of {len(a)}", checked, kept, span(where, 0)]


def measure(run: Run, args: argparse.Namespace) -> None:
    texts = [*QUESTIONS, *(text for prompts in WORKLOADS.values() for text in prompts)]
    texts = texts[:args.prompts] if args.prompts else texts
    off, on = pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_NGRAM
    with Sides() as sides:
        stub = sides.tokenspout(*SERVER_FLAGS, "--prefix-cache-exact").stub  # so that only speculation may part outputs
        runs = {(mode, group): outputs(stub, texts, args.tokens, mode, group) for group in (1, args.group) for mode in (off, on)}
    group = args.group
    run.table("", ["outputs compared", "differ", "proposed tokens checked", "kept", "first difference, cache position"], [
        compared("alone: off against n-gram", runs[off, 1], runs[on, 1], runs[on, 1]),
        compared(f"{group} at a time: off against n-gram", runs[off, group], runs[on, group], runs[on, group]),
        compared(f"off: alone against {group} at a time", runs[off, 1], runs[off, group], None),
    ])
