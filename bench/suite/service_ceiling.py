"""How many streams the service keeps up with when the engine costs nothing.
tokenspout on the fake engine paced as a GPU (`--step-s`), in each layout, and bench.harness.minimal_server (its step loop and
messages on bare grpc.aio): N streams from one client process; tokens/s over the ideal N / step while all N stream (steady) and
from the first request to the last message (whole). Last, the same work in one process without gRPC (CPU per token)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from backend import EngineConfig
from bench.harness.ceiling_client import measured
from bench.harness.minimal_server import MinimalServicer, Stream, deliver, one_step
from bench.harness.pairing import rotated, span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import Sides
from service.config import ServeConfig
from service.generation import GenerationServicer
from service.lifecycle import HealthServicer, Lifecycle
from service.limits import Limits
from service.validate import RequestValidator
from tests.harness.core_driver import Delivering
from tests.harness.fake_engine import FakeEngine
from tokenspout.v1 import generation_pb2 as pb

BENCHMARK = Benchmark(
    area="The service at a GPU's pace",
    smoke=("--streams", "4", "--tokens", "20", "--reps", "1", "--step-s", "0.005", "--layouts", "split", "--costs-streams", "16"),
    order=1,
)
LAYOUTS = {"split": (), "in-process": ("--engine-process", "false")}
"""tokenspout's layouts: the engine in a process of its own (the default), or on a thread of the server."""
TARGETS = {256: 0.97, 512: 0.95}
"""The whole run's fraction of the ideal in every rep, the start included."""
CPU_RATIO = 1.2
"""The server's CPU per token against the minimal server's, median of the reps."""


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", default="32,128,256,512", help="stream counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="tokenspout's layouts, comma-separated")
    parser.add_argument("--serve-flag", action="append", default=[], help="an extra flag for tokenspout serve")
    parser.add_argument("--costs-streams", type=int, default=256, help="calls of the in-process measure (0: none)")


def measure(run: Run, args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.streams.split(",")]
    layouts = args.layouts.split(",")
    most = str(max(counts))
    with Sides() as sides:
        servers: dict[str, tuple[str, int]] = {}
        for layout in layouts:
            served = sides.tokenspout("--max-batch-size", most, "--max-queued-requests", most, *LAYOUTS[layout],
                                      *args.serve_flag, fake_engine=True, faults=("--step-s", str(args.step_s)))
            servers[layout] = served.address, served.pid
        pid, address = sides.minimal_server(args.step_s)
        servers["minimal"] = address, pid
        for side in servers:  # warm: first calls, channels, the fake engine's tokenizer
            measured(*servers[side], 8, 20, args.step_s)
        runs = {streams: _reps(servers, streams, args) for streams in counts}
    rows = [_row(streams, layout, by_side) for streams, by_side in runs.items() for layout in layouts]
    run.table("", ["streams", "layout", "steady, tokenspout / minimal (range of the reps)", "whole run",
                   "server CPU per token, us", "CPU ratio", "p99 gap, ms", "client CPU per token, us"], rows)
    run.plot("tokens/s over the ideal (median of the reps)", "streams", "fraction of ideal", {
        f"{side}, {kind}": [(streams, statistics.median(values)) for streams, by_side in runs.items()
                            if (values := [r[key] for r in by_side[side] if r[key] is not None])]
        for side in [*layouts, "minimal"] for kind, key in (("steady", "of_ideal"), ("whole", "whole_of_ideal"))
    }, log_x=True)
    layout = layouts[0]  # the targets are the first layout's: the default's unless told
    for streams, bound in TARGETS.items():
        if streams in runs:
            run.target(f"whole run of ideal at {streams} streams, {layout}, worst rep",
                       min(r["whole_of_ideal"] for r in runs[streams][layout]), ">=", bound)
    if 256 in runs:
        run.target(f"server CPU per token over the minimal's at 256 streams, {layout}, median",
                   statistics.median(_cpu_ratios(runs[256], layout)), "<=", CPU_RATIO)
    if args.costs_streams:
        _costs(run, args.costs_streams, args.tokens, args.reps)


def _reps(servers: dict[str, tuple[str, int]], streams: int, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Each side's runs at `streams`, every side once a rep, which goes first rotating."""
    runs: dict[str, list[dict]] = {side: [] for side in servers}
    for rep in range(args.reps):
        for side in rotated(list(servers), rep):
            runs[side].append(measured(*servers[side], streams, args.tokens, args.step_s))
            time.sleep(0.5)  # the last streams' ends settle before the next run
    return runs


def _cpu_ratios(by_side: dict[str, list[dict]], layout: str) -> list[float]:
    pairs = zip(by_side[layout], by_side["minimal"])
    return [t["server_cpu_s"] / m["server_cpu_s"] for t, m in pairs if m["server_cpu_s"]]


def _row(streams: int, layout: str, by_side: dict[str, list[dict]]) -> list:
    def both(figure, digits: int = 2) -> str:
        return " / ".join(span([figure(r) for r in by_side[side]], digits) for side in (layout, "minimal"))

    ratios = _cpu_ratios(by_side, layout)
    # The median too: one rep in four or five lands far off (the host's scheduler).
    ratio = f"{span(ratios)} (median {statistics.median(ratios):.2f})" if ratios else "-"
    client = span([r["client_cpu_s"] / r["tokens"] * 1e6 for side in (layout, "minimal") for r in by_side[side]], 0)
    return [streams, layout, both(lambda r: r["of_ideal"]), both(lambda r: r["whole_of_ideal"]),
            both(lambda r: r["server_cpu_s"] / r["tokens"] * 1e6, 0), ratio, both(lambda r: r["p99_gap_s"] * 1e3, 0), client]


# -- the service's own work per token, in one process ------------------------------------------------------------

_TURNS_PER_STEP = 6
"""Loop turns given to the streams after each step: enough for every wake, message and write."""


class _Context:
    """What the calls read of their gRPC context; a write yields to the loop once, as its completion would,
    and is counted: messages, and the calls whose last message (one with a finish) went out."""

    def __init__(self) -> None:
        self.messages = self.finished = 0

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    async def write(self, message: Any) -> None:
        self.messages += 1
        self.finished += message.HasField("finish")
        await asyncio.sleep(0)


def _request(index: int, tokens: int) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        prompt=f"Rain falls {index}", request_id=f"costs-{index}", sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    )


async def _turns() -> None:
    for _ in range(_TURNS_PER_STEP):
        await asyncio.sleep(0)


async def tokenspout(streams: int, tokens: int) -> tuple[float, float, _Context]:
    """tokenspout's servicer, calls, relay and streams over the fake engine, whose steps run on this thread (the
    fake engine's, with the output bookkeeping every engine shares and the hand-over to the relay), timed apart
    from the loop's work that follows (each stream's wake, its message, a write): CPU seconds of each, and what
    was written."""
    engine_config = EngineConfig(max_batch_size=streams, max_queued_requests=streams)
    engine = FakeEngine(engine_config)
    engine.hold_steps()  # its worker thread applies the calls' commands; the steps run here, timed
    lifecycle = Lifecycle(HealthServicer())
    await lifecycle.start_serving()
    servicer = GenerationServicer(engine, RequestValidator(engine.info, Limits()), ServeConfig(engine=engine_config),
                                  lifecycle)
    context = _Context()

    async def call(index: int) -> None:
        async for _ in servicer.GenerateStream(_request(index, tokens), context):
            pass

    calls = [asyncio.create_task(call(i)) for i in range(streams)]
    while len(engine.core.waiting) < streams:
        await asyncio.sleep(0.001)
    core = Delivering(engine.core)  # each step settled and its events delivered, as the worker does
    engine_s = loop_s = 0.0
    for _ in range(tokens):
        start = time.process_time()
        core.step()
        stepped = time.process_time()
        await _turns()
        engine_s += stepped - start
        loop_s += time.process_time() - stepped
    await asyncio.gather(*calls)
    engine.close()
    return engine_s, loop_s, context


class _Steps:
    """Stands in for bench.harness.minimal_server's step thread: the streams it steps."""

    def __init__(self) -> None:
        self.running: list[Stream] = []

    def add(self, stream: Stream) -> None:
        self.running.append(stream)


async def minimal(streams: int, tokens: int) -> tuple[float, float, _Context]:
    """The same for bench.harness.minimal_server's handler and step loop."""
    servicer, steps, context = MinimalServicer(0.0), _Steps(), _Context()
    servicer._steps = steps
    calls = [asyncio.create_task(servicer.GenerateStream(_request(i, tokens), context)) for i in range(streams)]
    while len(steps.running) < streams:
        await asyncio.sleep(0.001)
    loop = asyncio.get_running_loop()
    engine_s = loop_s = 0.0
    for _ in range(tokens):
        start = time.process_time()
        step = one_step(steps.running)  # the minimal step loop's own work
        loop.call_soon_threadsafe(deliver, step)
        stepped = time.process_time()
        await _turns()
        engine_s += stepped - start
        loop_s += time.process_time() - stepped
    await asyncio.gather(*calls)
    return engine_s, loop_s, context


def _costs(run: Run, streams: int, tokens: int, reps: int) -> None:
    per_token = 1e6 / (streams * tokens)
    sides = {"tokenspout": tokenspout, "minimal": minimal}
    for side in sides.values():  # warm: first calls, imports, the fake engine's tokenizer
        asyncio.run(side(8, 10))
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for rep in range(reps):
        for name in rotated(list(sides), rep):
            engine_s, loop_s, _ = asyncio.run(sides[name](streams, tokens))
            figures[name].append((engine_s * per_token, loop_s * per_token))
    totals = {name: [e + loop for e, loop in values] for name, values in figures.items()}
    run.table("", [f"in one process, {streams} calls, CPU per token", "engine side, us", "loop side, us", "total, us",
                   "over the minimal's"],
              [[name, span([e for e, _ in values]), span([loop for _, loop in values]), span(totals[name]),
                round(statistics.median(totals[name]) / statistics.median(totals["minimal"]), 2)]
               for name, values in figures.items()])
