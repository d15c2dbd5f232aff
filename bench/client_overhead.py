"""What the Python client (tokenspout-client) costs over the raw generated stub, one run.

Prints, from one server on the embedded model:
  1. single-stream decode tokens/s through Client.stream / through the raw stub (target >= 0.98):
     the median of the pairs' ratios, and their range
  2. the same for AsyncClient.stream / the raw grpc.aio stub
  3. time to first token through the client minus through the stub, median
  4. the client's own cost per streamed message (turning it into a Chunk), in microseconds, and
     that cost as a share of the stub's time per token: what the client can take at most, which
     the machine's noise does not blur

Runs alternate stub and client, each going first in every other pair, so that drift in the
machine's speed affects both alike.

    python -m bench.client_overhead [--tokens 128] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time
import timeit

import grpc
import grpc.aio

from bench.common import PROMPTS, greedy_request
from tests.harness.servers import start_server, stop_server
from tokenspout import AsyncClient, Client, Stopping
from tokenspout import responses as rs
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def rates(arrivals: list[float], start: float, tokens: int) -> tuple[float, float]:
    """(seconds to the first message, decode tokens/s after it) from message arrival times."""
    return arrivals[0] - start, (tokens - 1) / (arrivals[-1] - arrivals[0])


def through_stub(stub, prompt: str, tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    arrivals = [time.perf_counter() for _ in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300)]
    return rates(arrivals, start, tokens)


def through_client(client: Client, prompt: str, tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    stopping = Stopping(max_new_tokens=tokens, ignore_eos=True)
    with client.stream(prompt, temperature=0.0, stopping=stopping) as stream:
        arrivals = [time.perf_counter() for _ in stream]
    assert stream.finish and stream.finish.usage.completion_tokens == tokens
    return rates(arrivals, start, tokens)


async def through_aio_stub(stub, prompt: str, tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    arrivals = [time.perf_counter() async for _ in stub.GenerateStream(greedy_request(prompt, tokens), timeout=300)]
    return rates(arrivals, start, tokens)


async def through_async_client(client: AsyncClient, prompt: str, tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    stopping = Stopping(max_new_tokens=tokens, ignore_eos=True)
    async with client.stream(prompt, temperature=0.0, stopping=stopping) as stream:
        arrivals = [time.perf_counter() async for _ in stream]
    return rates(arrivals, start, tokens)


def conversion_us() -> float:
    """Microseconds to turn one typical streamed message into a Chunk."""
    message = pb.GenerateStreamResponse(request_id="bench", text=" word", generated_tokens=17)
    runs = 20_000
    return timeit.timeit(lambda: rs.from_proto(rs.Chunk, message), number=runs) / runs * 1e6


async def async_pairs(address: str, tokens: int, reps: int) -> list[tuple[tuple, tuple]]:
    pairs = []
    async with grpc.aio.insecure_channel(address) as channel, AsyncClient(address) as client:
        stub = pb_grpc.GenerationServiceStub(channel)
        for i in range(reps + 1):
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                client_run = await through_async_client(client, prompt, tokens)
                pairs.append((await through_aio_stub(stub, prompt, tokens), client_run))
            else:
                stub_run = await through_aio_stub(stub, prompt, tokens)
                pairs.append((stub_run, await through_async_client(client, prompt, tokens)))
    return pairs[1:]  # the first pair warms the channel and the server's caches


def pair_ratios(pairs: list[tuple[tuple, tuple]]) -> list[float]:
    """Client decode rate / stub decode rate, per pair (each pair ran back to back)."""
    return [client[1] / stub[1] for stub, client in pairs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(pathlib.Path(tmp), "--max-batch-size", "1", "--context-length", "1024")
        try:
            sync_pairs = []
            with grpc.insecure_channel(server.address) as channel, Client(server.address) as client:
                stub = pb_grpc.GenerationServiceStub(channel)
                for i in range(args.reps + 1):
                    prompt = PROMPTS[i % len(PROMPTS)]
                    if i % 2:
                        client_run = through_client(client, prompt, args.tokens)
                        sync_pairs.append((through_stub(stub, prompt, args.tokens), client_run))
                    else:
                        stub_run = through_stub(stub, prompt, args.tokens)
                        sync_pairs.append((stub_run, through_client(client, prompt, args.tokens)))
            sync_pairs = sync_pairs[1:]
            aio_pairs = asyncio.run(async_pairs(server.address, args.tokens, args.reps))
        finally:
            stop_server(server)

    print(f"{args.reps} streams of {args.tokens} greedy tokens each way, alternating, one server (batch 1)")
    for name, pairs in (("Client", sync_pairs), ("AsyncClient", aio_pairs)):
        ratios = pair_ratios(pairs)
        stub_rate = statistics.median(stub[1] for stub, _ in pairs)
        client_rate = statistics.median(client[1] for _, client in pairs)
        ttft_delta = statistics.median((client[0] - stub[0]) * 1e3 for stub, client in pairs)
        print(f"{name:12s} decode {client_rate:7.1f} tok/s vs raw stub {stub_rate:7.1f} tok/s (medians);"
              f" ratio {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}, target >= 0.98);"
              f" first token {ttft_delta:+.2f} ms vs the stub")
    cost_us = conversion_us()
    token_us = 1e6 / statistics.median(stub[1] for stub, _ in sync_pairs)
    print(f"client cost per streamed message: {cost_us:.1f} us, {cost_us / token_us:.4%} of the stub's"
          f" {token_us / 1e3:.1f} ms per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
