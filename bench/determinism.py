"""How often greedy output differs with speculation on against off, over a corpus of prompts.

llama.cpp says its kernels may differ by batch shape; speculation changes the shape (a sequence's rows
checked in one pass, several at once). Each prompt runs greedy with speculation off, then with n-gram
proposals where the planner is made to check every one it is offered (the most rows a step can carry,
so the most exposure), alone and in groups of 8, the engine core driven in-process. Prints how many
outputs differ and at which token, and how many proposed tokens were checked and kept; and, as the
baseline speculation is judged against, how many differ between speculation off alone and off in a
group of 8 (a batch's company changes a lone sequence's numbers past 256 cached tokens:
docs/benchmarks.md).

    python -m bench.determinism [--tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from backend.common.models import default_model_path
from backend.llamacpp.model import GgufModel
from backend.llamacpp.speculation import speculator as speculator_module
from backend.types import ChatMessage, GenerationRequest, SamplingParams, SpeculationMode, SpeculationParams, StopParams
from bench.workloads import WORKLOADS
from tests.harness.core_driver import Recorder, make_core, run_until_idle, token_ids

ROOT = pathlib.Path(__file__).resolve().parent.parent

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
CHECK_EVERY = lambda candidates, costs: [len(c.proposed) for c in candidates]  # noqa: E731


def outputs(model, prompts: list[tuple[int, ...]], mode: SpeculationMode, group: int, tokens: int, threads: int):
    """Each prompt's greedy token ids, and (checked, kept) proposed tokens over all of them."""
    results, checked, kept = [], 0, 0
    for start in range(0, len(prompts), group):
        core = make_core(model, context_length=1024, max_batch_size=group, batch_tokens=512, threads=threads,
                         prefix_cache_exact=True)  # so that only speculation may part outputs
        try:
            recorders = []
            for i, prompt in enumerate(prompts[start:start + group]):
                request = GenerationRequest(f"p{start + i}", prompt, SamplingParams(temperature=0.0),
                                            StopParams(max_new_tokens=tokens, ignore_eos=True),
                                            speculation=SpeculationParams(mode, 16))
                recorders.append(Recorder(core))
                core.add(request, recorders[-1])
            run_until_idle(core)
            results += [token_ids(rec) for rec in recorders]
            checked += core.stats.draft_tokens_total
            kept += core.stats.accepted_draft_tokens_total
        finally:
            core.close()
    return results, checked, kept


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = GgufModel(default_model_path())
    texts = [*(text for prompts in WORKLOADS.values() for text in prompts), *QUESTIONS]
    prompts = [tuple(model.render_chat([ChatMessage("user", text)])) for text in texts]
    speculator_module.plan_drafts = CHECK_EVERY
    plain = {}
    for group in (1, 8):
        off, _, _ = outputs(model, prompts, SpeculationMode.OFF, group, args.tokens, args.threads)
        on, checked, kept = outputs(model, prompts, SpeculationMode.NGRAM, group, args.tokens, args.threads)
        plain[group] = off
        report(f"{group} at a time, speculation off against on", off, on, prompts,
               f"; proposed tokens checked {checked}, kept {kept}")
    report("speculation off, alone against 8 at a time", plain[1], plain[8], prompts)
    model.close()
    return 0


def report(what: str, a: list[list[int]], b: list[list[int]], prompts: list[tuple[int, ...]], extra: str = "") -> None:
    """How many outputs differ, and where: (prompt, output index, cache position)."""
    differ = [(i, first_difference(x, y)) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    where = [(i, index, len(prompts[i]) + index) for i, index in differ]
    print(f"{what}: {len(differ)} of {len(prompts)} greedy outputs differ ({len(a[0])} tokens each){extra}"
          + (f"; first differing token (prompt, output index, position): {where}" if differ else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
