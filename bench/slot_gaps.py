"""Closing slot gaps in llama.cpp's per-sequence cache, in-process, from one run.

Nine greedy sequences decode together; the one in slot 3 finishes after 4 tokens and leaves a
gap. Prints tokens/s of the other eight with and without moving a sequence into the gap
(`Slots.compact`), and whether every sequence's tokens came out the same both ways.

    python -m bench.slot_gaps [--reps 2]
"""

from __future__ import annotations

import argparse
import sys
import time

from backend.common.models import default_model_path
from backend.config import EngineConfig
from backend.llamacpp.core import LlamaCppCore
from backend.llamacpp.model import GgufModel
from backend.types import GenerationRequest, SamplingParams, StopParams
from backend.worker import deliver_all

PROMPTS = ["Water boils at", "The moon is", "Cats are", "Rain falls", "Trees grow", "Rivers run", "Bread is",
           "Snow is", "Sun is"]


def run(core: LlamaCppCore, model: GgufModel, close_gaps: bool) -> tuple[float, list[list[int]]]:
    if not close_gaps:
        core.slots.compact = lambda running: None
    events: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        core.add(
            GenerationRequest(
                f"{i}-{time.monotonic_ns()}", tuple(model.tokenize(prompt)), SamplingParams(temperature=0.0),
                StopParams(max_new_tokens=4 if i == 3 else 160, ignore_eos=True),
            ),
            events[i].append,
        )
    for _ in range(10):  # past the early finisher
        core.step()
        deliver_all(core.settle())
    before, start = sum(map(len, events.values())), time.perf_counter()
    while core.has_work():
        core.step()
        deliver_all(core.settle())
    rate = (sum(map(len, events.values())) - before) / (time.perf_counter() - start)
    if not close_gaps:
        del core.slots.compact
    return rate, [[t.token_id for e in events[i] for t in e.tokens] for i in sorted(events)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    model = GgufModel(default_model_path())
    core = LlamaCppCore(model, EngineConfig(context_length=1024, max_batch_size=9))
    for _ in range(args.reps):
        without, tokens_without = run(core, model, close_gaps=False)
        with_moves, tokens_with = run(core, model, close_gaps=True)
        print(f"gap left open {without:.0f} tok/s, gap closed {with_moves:.0f} tok/s, ratio {with_moves / without:.2f}; "
              f"same tokens: {tokens_without == tokens_with}")
    core.close()
    deliver_all(core.settle())
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
