"""What one llama_decode costs by its shape: the figures the speculation planner's cost model stands on
(backend/llamacpp/speculation/costs.py).

Eight sequences hold the same prompt; each shape decodes some rows of some of them (logits on every
row, as checked proposals have), the shapes in shuffled order, each many times. Prints the median time
of each shape with its forward passes (llama.cpp's equal split per sequence) and rows, and the line
`passes * pass + rows * row` fitted to every shape but the lone row.

    python -m bench.decode_costs [--threads 2] [--reps 15] [--model GGUF]

  --model  another GGUF (default: the embedded model)
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

import llama_cpp
import numpy as np

from backend.common.models import default_model_path
from backend.llamacpp.batch import Batch
from backend.llamacpp.model import GgufModel
from backend.llamacpp.speculation.costs import passes_for

ROOT = pathlib.Path(__file__).resolve().parent.parent

SHAPES = [
    *((k,) for k in range(1, 18)),
    (1,) * 4, (3, 1, 1, 1), (9, 1, 1, 1), (5,) * 4,
    (1,) * 8, *((k,) + (1,) * 7 for k in (2, 3, 5, 9, 17)), *((k,) * 8 for k in (2, 3, 5)),
    (5, 5, 1, 1, 1, 1, 1, 1), (5, 3, 2, 1, 1, 1, 1, 1),
]
"""Rows per sequence: one sequence checking 0 to 16 proposals, then 4 and 8 sequences, alike or not."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--model", type=pathlib.Path, default=None)
    args = parser.parse_args()
    model = GgufModel(args.model or default_model_path())
    ctx = model.new_context(8, 1024, 512, args.threads)
    memory = llama_cpp.llama_get_memory(ctx)
    batch = Batch(512)
    prompt = model.tokenize("Copy this passage exactly: the river rose through the night, and by morning the low "
                            "fields were a grey sheet of water.")
    for slot in range(8):
        batch.clear()
        batch.add(slot, 0, prompt, [False] * (len(prompt) - 1) + [True])
        assert batch.decode(ctx) == 0
    times: dict[tuple[int, ...], list[float]] = {shape: [] for shape in SHAPES}
    order = SHAPES * args.reps
    random.Random(1).shuffle(order)
    for shape in order:
        batch.clear()
        for slot, rows in enumerate(shape):
            batch.add(slot, len(prompt), [prompt[5 + slot]] * rows, [True] * rows)
        start = time.perf_counter()
        assert batch.decode(ctx) == 0
        times[shape].append(time.perf_counter() - start)
        for slot in range(len(shape)):
            llama_cpp.llama_memory_seq_rm(memory, slot, len(prompt), -1)
    print(f"{args.threads} threads, {args.reps} decodes of each shape, medians")
    medians = {shape: statistics.median(ts) for shape, ts in times.items()}
    fitted = [shape for shape in SHAPES if shape != (1,)]
    x = np.array([[passes_for(s), sum(s)] for s in fitted], dtype=float)
    t = np.array([medians[s] for s in fitted])
    (pass_s, row_s), *_ = np.linalg.lstsq(x / t[:, None], np.ones(len(t)), rcond=None)  # relative error
    for shape in SHAPES:
        line = passes_for(shape) * pass_s + sum(shape) * row_s
        print(f"{str(shape):34} passes {passes_for(shape)}  rows {sum(shape):3d}  {medians[shape] * 1000:7.2f} ms"
              f"  (line {line * 1000:6.1f})")
    print(f"line: {pass_s * 1000:.2f} ms a pass + {row_s * 1000:.2f} ms a row (every shape but the lone row)")
    batch.free()
    llama_cpp.llama_free(ctx)
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
