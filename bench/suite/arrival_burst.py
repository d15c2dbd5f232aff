"""What a burst of arrivals costs the engine thread.
N requests from 16 callers at once, in-process: into the llama.cpp engine's core (8 slots, its worker idle), the exllamav2 core's
admission (batch 256, fake generator); one at a time, or batched as the worker applies queued commands; then a step, full."""

from __future__ import annotations

import argparse
import statistics
import time

from backend import EngineConfig, GenerationRequest, SamplingParams, Scheduling, StopParams, build_engine
from bench.harness.pairing import span
from bench.harness.record import Benchmark, Run
from tests.harness.exllamav2_fakes import fake_core

BENCHMARK = Benchmark(
    area="The service at a GPU's pace",
    smoke=("--requests", "64", "--reps", "1"),
    order=2,
)
CALLERS = 16
EXLLAMAV2_BATCH = 256
STEPS = 64


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1024, help="requests of a burst (exllamav2: half as many)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", default="llamacpp,exllamav2", help="comma-separated")


def _requests(count: int, prompt: tuple[int, ...]) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), StopParams(max_new_tokens=STEPS),
                              scheduling=Scheduling(f"caller{i % CALLERS}", 1.0, 0)) for i in range(count)]


def burst(core, requests: list[GenerationRequest], batched: bool) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds each add took; `batched`: settled once after them all (the settle's time is the last add's)."""
    took = []
    for request in requests:
        start = time.perf_counter()
        core.add(request, lambda event: None)
        if not batched:
            core.settle()
        took.append(time.perf_counter() - start)
    if batched:
        start = time.perf_counter()
        core.settle()
        took[-1] += time.perf_counter() - start
    return took


def llamacpp(count: int, batched: bool) -> tuple[list[float], list[float]]:
    """A burst on a fresh llama.cpp engine's core: the engine's worker waits for commands and is sent none, so the
    core is this thread's until the engine closes."""
    engine = build_engine(EngineConfig.of(max_batch_size=8, max_queued_requests=count, context_length=512))
    try:
        return burst(engine.core, _requests(count, tuple(engine.tokenize("Hello there"))), batched), []
    finally:
        engine.close()


def exllamav2(count: int, batched: bool) -> tuple[list[float], list[float]]:
    """A burst on the exllamav2 core over the fake generator, then the host time of each of its steps."""
    driven, generators = fake_core(vocab_size=16, max_batch_size=EXLLAMAV2_BATCH, max_queued_requests=count)
    core = driven.core  # the core itself: its sinks here take nothing
    generators[0].samples.update({f"r{i}": [(10, b"x")] * STEPS for i in range(count)})
    took = burst(core, _requests(count, (1, 5, 6)), batched)
    steps = []
    for _ in range(STEPS // 2):
        start = time.perf_counter()
        core.step()
        core.settle()
        steps.append(time.perf_counter() - start)
    core.close()
    return took, steps


def measure(run: Run, args: argparse.Namespace) -> None:
    engines = {"llamacpp": (llamacpp, args.requests), "exllamav2": (exllamav2, args.requests // 2)}
    rows = []
    for engine in args.engines.split(","):
        bursts, count = engines[engine]
        row: list = [engine, count]
        steps: list[float] = []
        for batched in (False, True):
            reps = [bursts(count, batched) for _ in range(args.reps)]
            steps += [statistics.median(step_s) * 1e3 for _, step_s in reps if step_s]
            row += [span([sum(took) * 1e3 for took, _ in reps], 1),
                    f"{span([sum(took[:10]) / 10 * 1e6 for took, _ in reps], 0)} / "
                    f"{span([sum(took[-10:]) / 10 * 1e6 for took, _ in reps], 0)}"]
        rows.append([*row, span(steps)])
    run.table("", ["engine", "adds", "one at a time, ms", "first 10 / last 10, us each", "batched, ms",
                   "first 10 / last 10, us each", "then a step, ms"], rows)
