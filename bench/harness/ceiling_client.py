"""The client of the ceiling benchmarks (bench.suite.service_ceiling, process_split): N concurrent greedy streams
from one grpc.aio process, timed. `measured` runs it in a process of its own against one server.

Prints one JSON object: the streams' steady rate (tokens that arrived while all N were streaming,
over that window), the whole run's rate, when the last stream's first message came, the p99 gap
between one stream's consecutive messages,
the messages and tokens received, and this process's own CPU seconds (what the client costs).

    python -m bench.harness.ceiling_client ADDRESS --streams 256 --tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time

import grpc.aio

from bench.harness.record import ROOT
from bench.harness.streams import PROMPTS, cpu_seconds, greedy_request
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

_STREAMS_PER_CHANNEL = 128
"""A channel is one HTTP/2 connection; several spread the server's reads over its connections."""


async def one_stream(stub, index: int, tokens: int) -> list[tuple[float, int]]:
    """(arrival time, generated_tokens so far) of each message of one stream that must run to `tokens`."""
    request = greedy_request(f"{PROMPTS[index % len(PROMPTS)]} {index}", tokens)
    request.request_id = f"ceiling-{index}"
    arrivals = []
    async for message in stub.GenerateStream(request, timeout=600):
        arrivals.append((time.perf_counter(), message.generated_tokens))
    assert arrivals and arrivals[-1][1] == tokens, f"stream {index}: {arrivals[-1:]} of {tokens} tokens"
    return arrivals


def tokens_by(arrivals: list[tuple[float, int]], moment: float) -> int:
    """Tokens a stream had received by `moment`."""
    received = 0
    for at, generated in arrivals:
        if at > moment:
            break
        received = generated
    return received


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


async def run(address: str, streams: int, tokens: int) -> dict:
    channels = [grpc.aio.insecure_channel(address) for _ in range((streams - 1) // _STREAMS_PER_CHANNEL + 1)]
    stubs = [pb_grpc.GenerationServiceStub(channel) for channel in channels]
    for channel in channels:
        await channel.channel_ready()
    cpu_before = _cpu_s()
    start = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(stubs[i % len(stubs)], i, tokens) for i in range(streams)))
    end = max(arrivals[-1][0] for arrivals in runs)
    cpu = _cpu_s() - cpu_before
    for channel in channels:
        await channel.close()
    all_streaming = max(arrivals[0][0] for arrivals in runs)
    one_ended = min(arrivals[-1][0] for arrivals in runs)
    window = one_ended - all_streaming
    steady = sum(tokens_by(a, one_ended) - tokens_by(a, all_streaming) for a in runs) / window if window > 0 else 0.0
    gaps = [later[0] - earlier[0] for arrivals in runs for earlier, later in zip(arrivals, arrivals[1:])]
    return {
        "streams": streams,
        "steady_tokens_per_s": steady,
        "steady_window_s": window,
        "whole_tokens_per_s": streams * tokens / (end - start),
        "p99_gap_s": percentile(gaps, 0.99),
        "last_first_message_s": all_streaming - start,
        "messages": sum(len(arrivals) for arrivals in runs),
        "tokens": streams * tokens,
        "client_cpu_s": cpu,
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(address: str, pid: int, streams: int, tokens: int, step_s: float) -> dict:
    """One client run against the server at `address` (process `pid`): the client's figures, the server's CPU
    seconds (every process and thread of it) and the rates as fractions of the ideal `streams / step_s`."""
    before = cpu_seconds(pid)
    done = subprocess.run([sys.executable, "-m", "bench.harness.ceiling_client", address, "--streams", str(streams),
                           "--tokens", str(tokens)], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    result["server_cpu_s"] = cpu_seconds(pid) - before
    # Under a second with all N streaming (they started late), the steady rate means nothing: none.
    steady = result["steady_window_s"] >= 1.0
    result["of_ideal"] = result["steady_tokens_per_s"] / (streams / step_s) if steady else None
    result["whole_of_ideal"] = result["whole_tokens_per_s"] / (streams / step_s)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.harness.ceiling_client")
    parser.add_argument("address")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.address, args.streams, args.tokens))))


if __name__ == "__main__":
    main()
