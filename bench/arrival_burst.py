"""What a burst of arrivals costs the engine thread: N requests from 16 callers added at once, in-process,
to a llama.cpp core with 8 slots (all but 8 wait), or (`--engine exllamav2`) to the exllamav2 core's
admission with a batch of 256, over the fake generator of the tests (tests/harness/exllamav2_fakes.py:
what is timed is the admission's own work, which a GPU does not speed up). Each add runs the fair
policy's arrival, the shedding check, admission into the batch and the stats snapshot; while it does,
the engine thread holds the GIL, and the event loop's streams wait. Prints the total and the cost of
the first and last adds (an add that grows with the queue shows as a last add many times the first);
for exllamav2 also the host time of a step afterwards, the batch full and the rest queued (every step
ends with an admission pass over the queue). With `--batched`, the adds as the engine worker applies
commands that queued while its thread was busy: admission and the stats snapshot once, after all of
them (a real burst comes as a few such batches).

    python -m bench.arrival_burst [--engine llamacpp|exllamav2] [--requests 1024] [--reps 3] [--batched]
"""

from __future__ import annotations

import argparse
import statistics
import time

from backend.common.models import default_model_path
from backend.config import EngineConfig
from backend.llamacpp.core import LlamaCppCore
from backend.llamacpp.model import GgufModel
from backend.types import GenerationRequest, SamplingParams, Scheduling, StopParams
from tests.harness.exllamav2_fakes import fake_core

CALLERS = 16
EXLLAMAV2_BATCH = 256
STEPS = 64


def burst(model: GgufModel | None, requests: int, batched: bool) -> tuple[list[float], list[float]]:
    """Seconds each of `requests` adds took, on a fresh core (exllamav2's over the fake generator when `model`
    is None), and then each of its steps (exllamav2 only). `batched`: the adds as the engine worker applies
    commands that queued while its thread was busy, settled once after them (the settle's time is the
    last add's)."""
    if model is None:
        driven, generators = fake_core(vocab_size=16, max_batch_size=EXLLAMAV2_BATCH, max_queued_requests=requests)
        core = driven.core  # the core itself: its sinks here take nothing
        generators[0].samples.update({f"r{i}": [(10, b"x")] * STEPS for i in range(requests)})
        prompt: tuple[int, ...] = (1, 5, 6)
    else:
        core = LlamaCppCore(model, EngineConfig.of(max_batch_size=8, max_queued_requests=requests, context_length=512))
        prompt = tuple(model.tokenize("Hello there"))
    queued = [GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), StopParams(max_new_tokens=STEPS),
                                scheduling=Scheduling(f"caller{i % CALLERS}", 1.0, 0)) for i in range(requests)]
    took = []
    for request in queued:
        start = time.perf_counter()
        core.add(request, lambda event: None)
        if not batched:
            core.settle()
        took.append(time.perf_counter() - start)
    if batched:
        start = time.perf_counter()
        core.settle()
        took[-1] += time.perf_counter() - start
    steps = []
    for _ in range(STEPS // 2 if model is None else 0):
        start = time.perf_counter()
        core.step()
        core.settle()
        steps.append(time.perf_counter() - start)
    core.close()
    return took, steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("llamacpp", "exllamav2"), default="llamacpp")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batched", action="store_true", help="the adds as one batch of queued commands")
    args = parser.parse_args()
    model = GgufModel(default_model_path()) if args.engine == "llamacpp" else None
    for rep in range(args.reps):
        took, steps = burst(model, args.requests, args.batched)
        line = (f"rep {rep}: {args.requests} adds {sum(took) * 1000:.1f} ms; first 10 {sum(took[:10]) / 10 * 1e6:.0f} us "
                f"each, last 10 {sum(took[-10:]) / 10 * 1e6:.0f} us each")
        if steps:
            line += f"; then a step {statistics.median(steps) * 1000:.2f} ms (median of {len(steps)})"
        print(line, flush=True)
    if model is not None:
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
