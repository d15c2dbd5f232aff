"""The baseline of bench.service_ceiling: the same engine step loop and the same messages as tokenspout
on its fake engine, behind a bare grpc.aio server with nothing around them.

One thread steps every running stream by one token each `--step-s` (a step starts on the clock's tick,
as tests/harness/fake_engine.py's paced steps do) and hands the whole step to the event loop in one
call; each GenerateStream handler sends what has arrived for it as one message (one token while it
keeps up), with the fields tokenspout sets: request_id, text, generated_tokens, input_tokens on the
first message, finish with usage on the last. No validation, admission, fairness, telemetry or logs.

    python -m bench.harness.minimal_server --step-s 0.02    # prints "minimal server on 127.0.0.1:PORT"
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import grpc.aio

from tests.harness.fake_engine import output_text
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


class Stream:
    def __init__(self, request: pb.GenerateStreamRequest) -> None:
        self.request_id = request.request_id
        self.wanted = request.stopping.max_new_tokens or 16
        self.prompt = list(request.prompt.encode())
        self.text = output_text(self.prompt).decode()
        self.generated = 0
        self.queue: asyncio.Queue[str] = asyncio.Queue()


class StepLoop:
    """One token for every running stream each step, delivered to the loop once per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop, step_s: float) -> None:
        self._loop = loop
        self._step_s = step_s
        self._lock = threading.Lock()
        self._added: list[Stream] = []
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="minimal-engine", daemon=True).start()

    def add(self, stream: Stream) -> None:
        with self._lock:
            self._added.append(stream)
        self._wake.set()

    def _run(self) -> None:
        running: list[Stream] = []
        tick = time.monotonic()
        while True:
            if not running:
                self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            tick = tick + self._step_s if tick + self._step_s >= now else now + self._step_s  # as the fake engine
            time.sleep(tick - now)
            with self._lock:
                running += self._added
                self._added = []
            step = one_step(running)
            running = [stream for stream in running if stream.generated < stream.wanted]
            self._loop.call_soon_threadsafe(deliver, step)


def one_step(running: list[Stream]) -> list[tuple[Stream, str]]:
    """One token for every running stream: what a step hands the event loop (bench.suite.service_ceiling times it)."""
    step = []
    for stream in running:
        step.append((stream, stream.text[stream.generated % len(stream.text)]))
        stream.generated += 1
    return step


def deliver(step: list[tuple[Stream, str]]) -> None:
    for stream, text in step:
        stream.queue.put_nowait(text)


class MinimalServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, step_s: float) -> None:
        self._step_s = step_s
        self._steps: StepLoop | None = None

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        if self._steps is None:
            self._steps = StepLoop(asyncio.get_running_loop(), self._step_s)
        stream = Stream(request)
        self._steps.add(stream)
        sent = 0
        while sent < stream.wanted:
            texts = [await stream.queue.get()]
            while not stream.queue.empty():
                texts.append(stream.queue.get_nowait())
            sent += len(texts)
            message = pb.GenerateStreamResponse(request_id=stream.request_id, text="".join(texts),
                                                generated_tokens=sent)
            if sent == len(texts):
                message.input_tokens = len(stream.prompt)
            if sent >= stream.wanted:
                message.finish.reason = pb.FINISH_REASON_MAX_TOKENS
                message.finish.usage.prompt_tokens = len(stream.prompt)
                message.finish.usage.completion_tokens = sent
            await context.write(message)


async def serve(step_s: float, listen: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(MinimalServicer(step_s), server)
    port = server.add_insecure_port(listen)
    await server.start()
    print(f"minimal server on {listen.rsplit(':', 1)[0]}:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.harness.minimal_server")
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--listen", default="127.0.0.1:0")
    args = parser.parse_args()
    asyncio.run(serve(args.step_s, args.listen))


if __name__ == "__main__":
    main()
