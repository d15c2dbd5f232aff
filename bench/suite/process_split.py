"""The service against the engine driven directly, on an engine whose step costs what a GPU engine's does.
The fake engine's step: `--step-cpu-s` of Python holding the GIL (exllamav2 launching kernels), then `--step-s` released. tokens/s
of `tokenspout serve` on it (split, in-process; N client streams) over the engine alone, while all N stream (steady) and whole."""

from __future__ import annotations

import argparse
import threading
import time

from backend import EngineConfig, ErrorEvent, GenerationRequest, SamplingParams, StopParams, TokenEvent
from bench.harness.ceiling_client import measured
from bench.harness.pairing import rotated, span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from bench.harness.streams import PROMPTS
from tests.harness.fake_engine import FakeEngine, FakeVocabulary

BENCHMARK = Benchmark(
    area="The engine in a process of its own",
    smoke=("--streams", "4", "--tokens", "40", "--reps", "1", "--steps", "0.003+0.001"),
    order=1,
)
LAYOUTS = {"split": (), "in-process": ("--engine-process", "false")}
TARGET = 0.97
"""gRPC / direct, steady, at every stream count: the service keeps the engine's pace."""


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", default="1,4,16,64", help="stream counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", default="0.003+0.001,0.002+0.002",
                        help="engine steps, each CPU seconds holding the GIL + seconds released, comma-separated")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated")


def direct(streams: int, tokens: int, step_cpu_s: float, step_s: float) -> dict[str, float]:
    """The fake engine alone: N greedy requests at once, their events counted as they come (steady: while all N
    produce tokens; whole: from the first submit to the last token)."""
    engine = FakeEngine(EngineConfig(max_batch_size=streams, max_queued_requests=streams), step_s, step_cpu_s)
    vocabulary = FakeVocabulary()
    done = threading.Event()
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(streams)]
    finished = [0]

    def sink(index: int):  # type: ignore[no-untyped-def]  # one per stream: appends, and notes the last finish
        def take(event: TokenEvent | ErrorEvent) -> None:
            assert isinstance(event, TokenEvent), event
            arrivals[index].append((time.perf_counter(), event.generated_tokens))
            if event.finish is not None:
                finished[0] += 1
                if finished[0] == streams:
                    done.set()
        return take

    try:
        start = time.perf_counter()
        for i in range(streams):
            prompt = tuple(vocabulary.tokenize(f"{PROMPTS[i % len(PROMPTS)]} {i}"))
            engine.submit(GenerationRequest(f"direct-{i}", prompt, SamplingParams(temperature=0.0),
                                            StopParams(max_new_tokens=tokens, ignore_eos=True)), sink(i))
        assert done.wait(600), "the engine did not finish"
    finally:
        engine.close()
    end = max(stream[-1][0] for stream in arrivals)
    all_streaming = max(stream[0][0] for stream in arrivals)
    one_ended = min(stream[-1][0] for stream in arrivals)
    steady = sum(_tokens_by(s, one_ended) - _tokens_by(s, all_streaming) for s in arrivals) / (one_ended - all_streaming)
    return {"steady": steady, "whole": streams * tokens / (end - start)}


def _tokens_by(arrivals: list[tuple[float, int]], moment: float) -> int:
    return max((generated for at, generated in arrivals if at <= moment), default=0)


def measure(run: Run, args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.streams.split(",")]
    layouts = args.layouts.split(",")
    rows: list[list] = [[streams] for streams in counts]
    columns = ["streams"]
    curves: dict[str, list[tuple[float, float]]] = {}
    for shape in args.steps.split(","):
        step_cpu_s, step_s = (float(part) for part in shape.split("+"))
        label = f"{step_cpu_s * 1e3:g} + {step_s * 1e3:g} ms"
        columns += [*(f"{label}, {layout}: steady / whole" for layout in layouts), f"cores busy, {layouts[0]}: server + client"]
        by_count = _shape(counts, layouts, step_cpu_s, step_s, args)
        for row, ratios in zip(rows, by_count.values()):
            for layout in layouts:
                steady = ratios[layout]["steady"]
                row.append(f"{span(steady)} / {span(ratios[layout]['whole'])}")
                curves.setdefault(f"{layout}, {label}", []).append((row[0], sorted(steady)[len(steady) // 2]))
            row.append(f"{span(ratios[layouts[0]]['server'])} + {span(ratios[layouts[0]]['client'])}")
        run.target(f"gRPC / direct, steady, {layouts[0]}, {label}, every stream count",
                   min(min(ratios[layouts[0]]["steady"]) for ratios in by_count.values()), ">=", TARGET)
    run.table("", columns, rows)
    run.plot("gRPC / direct tokens/s while all streams run (median of the reps)", "streams", "gRPC / direct", curves,
             log_x=True)


def _shape(counts: list[int], layouts: list[str], step_cpu_s: float, step_s: float,
           args: argparse.Namespace) -> dict[int, dict[str, dict[str, list[float]]]]:
    """For each stream count, each layout's gRPC / direct ratios (steady, whole) and cores busy (server, client)."""
    most = str(max(counts))
    by_count = {}
    with Sides() as sides:
        servers = {layout: sides.tokenspout("--max-batch-size", most, "--max-queued-requests", most, *LAYOUTS[layout],
                                            fake_engine=True, faults=("--step-cpu-s", str(step_cpu_s), "--step-s", str(step_s)))
                   for layout in layouts}
        for served in servers.values():  # warm: first calls, channels, the fake engine's tokenizer
            measured(served.address, served.pid, 4, 20, 1.0)
        for streams in counts:
            baseline: list[dict[str, float]] = []
            figures = {layout: {"steady": [], "whole": [], "server": [], "client": []} for layout in layouts}
            for rep in range(args.reps):
                for side in rotated(["direct", *layouts], rep):
                    if side == "direct":
                        baseline.append(direct(streams, args.tokens, step_cpu_s, step_s))
                        continue
                    result = measured(servers[side].address, servers[side].pid, streams, args.tokens, 1.0)
                    seconds = result["tokens"] / result["whole_tokens_per_s"]
                    figures[side]["steady"].append(result["steady_tokens_per_s"])
                    figures[side]["whole"].append(result["whole_tokens_per_s"])
                    figures[side]["server"].append(result["server_cpu_s"] / seconds)
                    figures[side]["client"].append(result["client_cpu_s"] / seconds)
                    time.sleep(0.5)
            steady = sorted(b["steady"] for b in baseline)[len(baseline) // 2]
            whole = sorted(b["whole"] for b in baseline)[len(baseline) // 2]
            for layout in layouts:
                figures[layout]["steady"] = [r / steady for r in figures[layout]["steady"]]
                figures[layout]["whole"] = [r / whole for r in figures[layout]["whole"]]
            by_count[streams] = figures
    return by_count
