"""What the layers around a call cost: the Python client, an API key, tracing.
Each layer against the same call without it, rep by rep: `Client` / raw stub and `AsyncClient` / raw `grpc.aio` stub on one
server; servers with an API-keys file and exporting every span to a local OTLP collector, against one with neither.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import time
import timeit

import grpc
import grpc.aio

from bench.harness.pairing import alternate, span
from bench.harness.record import Benchmark, Run
from bench.harness.sides import SERVER_FLAGS, Sides
from bench.harness.streams import PROMPTS, aggregate_rate, cpu_seconds, decode_rate, greedy_request, timed_stream
from tests.harness.otlp_collector import start_collector
from tokenspout import AsyncClient, Client, Stopping
from tokenspout import responses as rs
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BENCHMARK = Benchmark(
    area="Client, authentication, tracing and proxy overhead",
    smoke=("--tokens", "8", "--reps", "1", "--calls", "20", "--streams", "2"),
)
KEY = "bench-key-0"
MIN_CPU_S = 0.2  # 20 ticks of the /proc clock: the CPU per call to within 5%


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per stream")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000, help="GetModelInfo calls per rep, for the CPU per call")
    parser.add_argument("--keys", type=int, default=100, help="keys in the keyed server's file")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams, tracing's second figure")


def through_client(client: Client, prompt: str, tokens: int) -> float:
    start = time.perf_counter()
    with client.stream(prompt, temperature=0.0, stopping=Stopping(max_new_tokens=tokens, ignore_eos=True)) as stream:
        arrivals = [time.perf_counter() for _ in stream]
    assert stream.finish and stream.finish.usage.completion_tokens == tokens
    return decode_rate(start, arrivals, tokens)


async def through_aio_stub(stub, prompt: str, tokens: int) -> float:
    start = time.perf_counter()
    arrivals = [time.perf_counter() async for _ in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300)]
    return decode_rate(start, arrivals, tokens)


async def through_async_client(client: AsyncClient, prompt: str, tokens: int) -> float:
    start = time.perf_counter()
    async with client.stream(prompt, temperature=0.0, stopping=Stopping(max_new_tokens=tokens, ignore_eos=True)) as stream:
        arrivals = [time.perf_counter() async for _ in stream]
    return decode_rate(start, arrivals, tokens)


def conversion_us() -> float:
    """Microseconds to turn one typical streamed message into a Chunk: the client's own work per message."""
    message = pb.GenerateStreamResponse(request_id="bench", text=" word", generated_tokens=17)
    runs = 20_000
    return timeit.timeit(lambda: rs.from_proto(rs.Chunk, message), number=runs) / runs * 1e6


def unary_cpu_us(stub, pid: int, calls: int, metadata: tuple = ()) -> float:
    """The server's CPU microseconds per GetModelInfo call, calls sent one after another: at least `calls`, and
    more until the server has spent MIN_CPU_S, since /proc counts CPU time in 10 ms ticks (a few calls read 0)."""
    start, sent = cpu_seconds(pid), 0
    while sent < calls or cpu_seconds(pid) - start < MIN_CPU_S:
        for _ in range(calls):
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=metadata)
        sent += calls
    return (cpu_seconds(pid) - start) / sent * 1e6


def keys_text(count: int) -> str:
    return "".join(f"caller-{i}:{hashlib.sha256(f'bench-key-{i}'.encode()).hexdigest()}\n" for i in range(count))


def measure(run: Run, args: argparse.Namespace) -> None:
    keyed_metadata = (("authorization", f"Bearer {KEY}"),)
    tokens, reps = args.tokens, range(args.reps)
    with Sides() as sides:
        collector, receiver, port = start_collector()
        sides.callback(receiver.stop, None)  # after the traced server has flushed its last spans
        keys_file = sides.tmp / "api-keys"
        keys_file.write_text(keys_text(args.keys))
        untraced = {name: "" for name in os.environ if name.startswith("OTEL_")}
        bare = sides.tokenspout(env=untraced)
        keyed = sides.tokenspout(*SERVER_FLAGS, "--api-keys-file", str(keys_file), env=untraced)
        traced = sides.tokenspout(env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                       "OTEL_EXPORTER_OTLP_INSECURE": "true"})
        client = sides.enter_context(Client(bare.address))
        loop = sides.enter_context(asyncio.Runner())

        async def on_the_loop():  # a grpc.aio channel belongs to the loop it was made on
            return grpc.aio.insecure_channel(bare.address), AsyncClient(bare.address)

        aio_channel, async_client = loop.run(on_the_loop())
        aio_stub = pb_grpc.GenerationServiceStub(aio_channel)
        one_stream = {
            "stub": lambda p: timed_stream(bare.stub, p, tokens)[1],
            "Client": lambda p: through_client(client, p, tokens),
            "aio stub": lambda p: loop.run(through_aio_stub(aio_stub, p, tokens)),
            "AsyncClient": lambda p: loop.run(through_async_client(async_client, p, tokens)),
            "API key": lambda p: keyed_rate(keyed.stub, p, tokens, keyed_metadata),
            "tracing": lambda p: timed_stream(traced.stub, p, tokens)[1],
        }
        for side in one_stream.values():  # warm every channel and server
            side(PROMPTS[0])
        rates = alternate(one_stream, (PROMPTS[rep % len(PROMPTS)] for rep in reps))
        many = alternate({"stub": lambda _: aggregate_rate(bare.stub, args.streams, tokens),
                          "tracing": lambda _: aggregate_rate(traced.stub, args.streams, tokens)}, reps)
        unary = alternate({"stub": lambda _: unary_cpu_us(bare.stub, bare.pid, args.calls),
                           "API key": lambda _: unary_cpu_us(keyed.stub, keyed.pid, args.calls, keyed_metadata)}, reps)
        loop.run(async_client.close())
        loop.run(aio_channel.close())
    assert args.tokens < 8 or collector.spans, "the traced server exported no span"
    rows, ratios = [], {}
    for layer, without, measured, samples in (
        ("Client", "stub", "decode tokens/s, 1 stream", rates),
        ("AsyncClient", "aio stub", "decode tokens/s, 1 stream", rates),
        ("API key", "stub", "decode tokens/s, 1 stream", rates),
        ("API key", "stub", "server CPU per unary call, us", unary),
        ("tracing", "stub", "decode tokens/s, 1 stream", rates),
        ("tracing", "stub", f"decode tokens/s, {args.streams} streams", many),
    ):
        per_rep = [w / wo for w, wo in zip(samples[layer], samples[without], strict=True)]
        ratios[layer, measured] = statistics.median(per_rep)
        rows.append([_named(layer, args.keys), measured, round(statistics.median(samples[layer]), 1),
                     round(statistics.median(samples[without]), 1), f"{ratios[layer, measured]:.3f} ({span(per_rep, 3)})"])
        if layer == "AsyncClient":
            cost_us, token_us = conversion_us(), 1e6 / statistics.median(rates["stub"])
            rows.append(["the client's own work", "us per message", round(cost_us, 1), None,
                         f"{100 * cost_us / token_us:.2f}% of a token"])
    run.table("", ["layer", "measure", "with", "without", "with / without, median of reps (range)"], rows)
    run.target("Client / raw stub, decode", ratios["Client", "decode tokens/s, 1 stream"], ">=", 0.98)
    run.target("AsyncClient / raw grpc.aio stub, decode", ratios["AsyncClient", "decode tokens/s, 1 stream"], ">=", 0.98)
    run.target("tracing on / off, decode, 1 stream", ratios["tracing", "decode tokens/s, 1 stream"], ">=", 0.97)
    run.target(f"tracing on / off, decode, {args.streams} streams", ratios["tracing", f"decode tokens/s, {args.streams} streams"],
               ">=", 0.97)


def keyed_rate(stub, prompt: str, tokens: int, metadata: tuple) -> float:
    start = time.perf_counter()
    arrivals = [time.perf_counter() for _ in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300, metadata=metadata)]
    return decode_rate(start, arrivals, tokens)


def _named(layer: str, keys: int) -> str:
    return {"API key": f"API key ({keys:,} keys)", "tracing": "tracing (every span exported)"}.get(layer, layer)
