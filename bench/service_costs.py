"""The service's own work per token, in-process and without gRPC: tokenspout's servicer, calls, relay and
streams over the fake engine, against bench.minimal_server's handler and step loop, in one process.

bench.service_ceiling measures whole servers, whose CPU per token moves by a fifth between reps on a
shared host; this takes gRPC, the other threads and the scheduler out, so a change of a few tenths of
a microsecond shows. N calls each want `--tokens` tokens; every step, the engine's step (the fake
engine's, with the output bookkeeping every engine shares, and the hand-over to the relay) runs on the
event loop's thread, timed apart from the loop's work that follows (each stream's wake, its message,
and a write that yields to the loop once, as a gRPC write's completion does). `time.process_time`.

    python -m bench.service_costs [--streams 256] [--tokens 200] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from backend import EngineConfig
from backend.worker import deliver_all
from bench.minimal_server import MinimalServicer, _deliver, _Stream
from service.config import ServeConfig
from service.generation import GenerationServicer
from service.lifecycle import HealthServicer, Lifecycle
from service.limits import Limits
from service.validate import RequestValidator
from tests.harness.fake_engine import FakeEngine
from tokenspout.v1 import generation_pb2 as pb

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
    """Seconds of CPU on the engine's side and on the loop's, over the whole run, and what was written."""
    engine = FakeEngine(EngineConfig(max_batch_size=streams, max_queued_requests=streams))
    engine.hold_steps()  # its worker thread applies the calls' commands; the steps run here, timed
    config = ServeConfig(engine=EngineConfig(max_batch_size=streams, max_queued_requests=streams))
    lifecycle = Lifecycle(HealthServicer())
    await lifecycle.start_serving()
    servicer = GenerationServicer(engine, RequestValidator(engine.info, Limits()), config, lifecycle)

    context = _Context()

    async def call(index: int) -> None:
        async for _ in servicer.GenerateStream(_request(index, tokens), context):
            pass

    calls = [asyncio.create_task(call(i)) for i in range(streams)]
    while len(engine.core.waiting) < streams:
        await asyncio.sleep(0.001)
    engine_s = loop_s = 0.0
    for _ in range(tokens):
        start = time.process_time()
        engine.core.step()
        deliver_all(engine.core.settle())
        stepped = time.process_time()
        await _turns()
        engine_s += stepped - start
        loop_s += time.process_time() - stepped
    await asyncio.gather(*calls)
    engine.close()
    return engine_s, loop_s, context


class _Steps:
    """Stands in for bench.minimal_server's step thread: the streams it steps."""

    def __init__(self) -> None:
        self.running: list[_Stream] = []

    def add(self, stream: _Stream) -> None:
        self.running.append(stream)


async def minimal(streams: int, tokens: int) -> tuple[float, float, _Context]:
    servicer, steps, context = MinimalServicer(0.0), _Steps(), _Context()
    servicer._steps = steps
    calls = [asyncio.create_task(servicer.GenerateStream(_request(i, tokens), context)) for i in range(streams)]
    while len(steps.running) < streams:
        await asyncio.sleep(0.001)
    loop = asyncio.get_running_loop()
    engine_s = loop_s = 0.0
    for _ in range(tokens):
        start = time.process_time()
        step = []  # the minimal step loop's own work, as in bench.minimal_server
        for stream in steps.running:
            step.append((stream, stream.text[stream.generated % len(stream.text)]))
            stream.generated += 1
        loop.call_soon_threadsafe(_deliver, step)
        stepped = time.process_time()
        await _turns()
        engine_s += stepped - start
        loop_s += time.process_time() - stepped
    await asyncio.gather(*calls)
    return engine_s, loop_s, context


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.service_costs")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    per_token = 1e6 / (args.streams * args.tokens)
    for side in (tokenspout, minimal):  # warm: first calls, imports, the fake engine's tokenizer
        asyncio.run(side(8, 10))
    totals: dict[str, list[float]] = {"tokenspout": [], "minimal": []}
    for rep in range(args.reps):
        for name, side in (("tokenspout", tokenspout), ("minimal", minimal))[:: 1 if rep % 2 == 0 else -1]:
            engine_s, loop_s, _ = asyncio.run(side(args.streams, args.tokens))
            totals[name].append((engine_s + loop_s) * per_token)
            print(f"{name:10s} rep {rep}: engine side {engine_s * per_token:.2f} us a token, "
                  f"loop side {loop_s * per_token:.2f} us", flush=True)
    ratio = statistics.median(totals["tokenspout"]) / statistics.median(totals["minimal"])
    print(f"median us a token: tokenspout {statistics.median(totals['tokenspout']):.2f}, "
          f"minimal {statistics.median(totals['minimal']):.2f}, ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
