"""The service against the engine driven directly, on an engine whose step costs what a GPU engine's does:
tokens/s through gRPC over tokens/s of the same fake engine with nothing in front of it, for each process
layout, in one run.

The fake engine's step is `--step-cpu-s` of pure Python holding the GIL (exllamav2's own Python, launching
the step's kernels), then `--step-s` released (the kernels' wait), one after the other: 3 ms + 1 ms is a
small model on a fast GPU, Python-bound, like the H200 runs (docs/benchmarks.md). For each stream count N:

    direct   the fake engine on its worker thread in this process, N requests of `--tokens` tokens, its
             events to sinks that only count them
    gRPC     `tokenspout serve` on the same engine (--fake-engine --step-cpu-s --step-s), one layout each:
             split (the engine in a process of its own, the default) and in-process
             (--engine-process false); bench.ceiling_client's N streams

and prints, per layout, gRPC / direct for the steady rate (while all N stream) and the whole run (from
the first request to the last token), each over `--reps` reps, sides alternating, and the cores the server
(all its processes) and the client kept busy over the run: where that nears the machine's cores, the
machine, not the layout, sets the ceiling.

    python -m bench.process_split [--streams 1,4,16,64] [--tokens 200] [--step-cpu-s 0.003] [--step-s 0.001]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import threading
import time

from backend.config import EngineConfig
from backend.events import ErrorEvent, TokenEvent
from backend.types import GenerationRequest, SamplingParams, StopParams
from bench.common import PROMPTS
from bench.service_ceiling import measure, span
from tests.harness.fake_engine import FakeEngine, FakeVocabulary
from tests.harness.servers import start_server, stop_server

LAYOUTS = {"split": (), "in-process": ("--engine-process", "false")}


def direct(streams: int, tokens: int, step_cpu_s: float, step_s: float) -> dict[str, float]:
    """The fake engine alone: N greedy requests at once, their events counted as they come (steady: while all N
    produce tokens; whole: from the first submit to the last token)."""
    engine = FakeEngine(EngineConfig(max_batch_size=streams, max_queued_requests=streams), step_s, step_cpu_s)
    vocabulary = FakeVocabulary()
    done = threading.Event()
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(streams)]
    finished = [0]

    def sink(index: int):  # one per stream: appends, and notes the last finish
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.process_split")
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--step-cpu-s", type=float, default=0.003)
    parser.add_argument("--step-s", type=float, default=0.001)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    layouts = args.layouts.split(",")
    most = max(counts)
    step = ("--step-cpu-s", str(args.step_cpu_s), "--step-s", str(args.step_s))
    flags = ("--max-batch-size", str(most), "--max-queued-requests", str(most))
    print(f"fake engine step: {args.step_cpu_s * 1e3:g} ms holding the GIL + {args.step_s * 1e3:g} ms released; "
          f"{args.tokens} tokens a stream, {args.reps} reps")
    print("| streams | direct tok/s (steady) | "
          + " | ".join(f"{layout}: gRPC/direct steady | whole | cores busy, server + client" for layout in layouts)
          + " |\n|" + "---|" * (2 + 3 * len(layouts)))
    with tempfile.TemporaryDirectory() as tmp:
        servers = {layout: start_server(pathlib.Path(tmp), *flags, *LAYOUTS[layout], faults=step, fake_engine=True)
                   for layout in layouts}
        try:
            for layout in layouts:  # warm: first calls, channels, the fake engine's tokenizer
                measure(servers[layout].address, servers[layout].process.pid, 4, 20, args.step_s + args.step_cpu_s)
            for streams in counts:
                baseline: list[dict[str, float]] = []
                ratios: dict[str, dict[str, list[float]]] = {
                    layout: {"steady": [], "whole": [], "server": [], "client": []} for layout in layouts
                }
                for rep in range(args.reps):
                    order = ["direct", *layouts]
                    for side in order if rep % 2 == 0 else order[::-1]:
                        if side == "direct":
                            baseline.append(direct(streams, args.tokens, args.step_cpu_s, args.step_s))
                            continue
                        server = servers[side]
                        result = measure(server.address, server.process.pid, streams, args.tokens, 1.0)
                        ratios[side]["steady"].append(result["steady_tokens_per_s"])
                        ratios[side]["whole"].append(result["whole_tokens_per_s"])
                        seconds = result["tokens"] / result["whole_tokens_per_s"]
                        ratios[side]["server"].append(result["server_cpu_s"] / seconds)
                        ratios[side]["client"].append(result["client_cpu_s"] / seconds)
                        time.sleep(0.5)
                steady = sorted(b["steady"] for b in baseline)[len(baseline) // 2]
                whole = sorted(b["whole"] for b in baseline)[len(baseline) // 2]
                cells = [str(streams), f"{steady:.0f}"]
                for layout in layouts:
                    cells.append(span([r / steady for r in ratios[layout]["steady"]]))
                    cells.append(span([r / whole for r in ratios[layout]["whole"]]))
                    cells.append(f"{span(ratios[layout]['server'])} + {span(ratios[layout]['client'])}")
                print("| " + " | ".join(cells) + " |", flush=True)
        finally:
            for server in servers.values():
                stop_server(server)


if __name__ == "__main__":
    main()
