"""What computing a burst's prompts together would save: the trade behind tokenspout's one prompt per step.

N short prompts arrive at once. tokenspout's llama.cpp engine computes them one after another, each in a
llama_decode of its own (backend.llamacpp.scheduler), so each caller's first token comes as soon as its own
prompt is done; llama-server computes them all in one batch, so every first token comes when the last prompt
is done. In-process, on the embedded model, unique prompts each rep (nothing cached), logits on each prompt's
last row only; both ways in turn, rotating which goes first. Prints the median time of each way, the ratio,
when each way's prompts are done (the first token times a burst would see, before sampling and sending), and
whether every prompt's logits came out bit-identical both ways.

    python -m bench.prompt_batching [--prompts 8] [--reps 5] [--threads 2] [--same-length]

  --same-length  every prompt cut to the shortest one's tokens: llama.cpp splits a batch over per-sequence
                 caches into equal pieces per sequence, so prompts of unequal length take extra passes
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp
import numpy as np

from backend.common.models import default_model_path
from backend.llamacpp.batch import Batch
from backend.llamacpp.layout import PromptLayout
from backend.llamacpp.model import GgufModel
from bench.streaming import PROMPTS

BATCH_TOKENS = 512
Done = tuple[list[float], list[np.ndarray]]
"""When each prompt was done (seconds from the start), and its last row's logits."""


def _emptied(ctx: llama_cpp.llama_context_p) -> None:
    """Every sequence's cells gone, so each way computes its prompts from nothing."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)


def one_by_one(model: GgufModel, ctx: llama_cpp.llama_context_p, batch: Batch, prompts: list[list[int]]) -> Done:
    """Each prompt in llama_decode calls of its own, its rows grouped as its layout says (as tokenspout does)."""
    _emptied(ctx)
    start = time.perf_counter()
    done: list[float] = []
    logits: list[np.ndarray] = []
    for slot, tokens in enumerate(prompts):
        layout, position = PromptLayout.of(len(tokens), 0, BATCH_TOKENS), 0
        while position < len(tokens):
            count = layout.next_group(position, BATCH_TOKENS)
            batch.clear()
            rows = batch.add(slot, position, tokens[position : position + count],
                             [position + i == len(tokens) - 1 for i in range(count)])
            assert batch.decode(ctx) == 0
            position += count
        logits.append(model.logits_row(ctx, rows[-1]).copy())
        done.append(time.perf_counter() - start)
    return done, logits


def together(model: GgufModel, ctx: llama_cpp.llama_context_p, batch: Batch, prompts: list[list[int]]) -> Done:
    """Every prompt in one llama_decode, as llama-server batches them."""
    _emptied(ctx)
    start = time.perf_counter()
    batch.clear()
    last = [batch.add(slot, 0, tokens, [i == len(tokens) - 1 for i in range(len(tokens))])[-1]
            for slot, tokens in enumerate(prompts)]
    assert batch.decode(ctx) == 0
    done = time.perf_counter() - start
    return [done] * len(prompts), [model.logits_row(ctx, row).copy() for row in last]


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.prompt_batching")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--same-length", action="store_true")
    args = parser.parse_args()
    model = GgufModel(default_model_path())
    ctx = model.new_context(args.prompts, 256, BATCH_TOKENS, args.threads)
    batch = Batch(BATCH_TOKENS)
    ways = {"one by one": one_by_one, "together": together}
    done: dict[str, list[list[float]]] = {name: [] for name in ways}
    identical = compared = 0
    for rep in range(-1, args.reps):  # rep -1 warms up
        prompts = [model.tokenize(f"Request {rep * args.prompts + i} of {time.monotonic_ns()}: {PROMPTS[i % len(PROMPTS)]}")
                   for i in range(args.prompts)]
        if args.same_length:
            shortest = min(map(len, prompts))
            prompts = [tokens[:shortest] for tokens in prompts]
        lengths = [len(tokens) for tokens in prompts]
        logits = []
        for name in list(ways)[:: 1 if rep % 2 == 0 else -1]:
            times, rows = ways[name](model, ctx, batch, prompts)
            logits.append(rows)
            if rep >= 0:
                done[name].append(times)
        if rep >= 0:
            identical += sum(np.array_equal(a, b) for a, b in zip(*logits))
            compared += args.prompts
    print(f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, {args.threads} threads, {args.reps} reps")
    medians = {name: [statistics.median(column) for column in zip(*runs)] for name, runs in done.items()}
    for name, times in medians.items():
        print(f"  {name}: all done {times[-1] * 1000:.1f} ms; each done at median {statistics.median(times) * 1000:.1f} ms"
              f" (first {times[0] * 1000:.1f})")
    print(f"  together / one by one, all done: {medians['together'][-1] / medians['one by one'][-1]:.3f}; "
          f"median done: {statistics.median(medians['together']) / statistics.median(medians['one by one']):.3f}")
    print(f"  logits bit-identical both ways: {identical} of {compared} prompts")
    batch.free()
    llama_cpp.llama_free(ctx)
    model.close()


if __name__ == "__main__":
    main()
