"""What the benchmarks share: greedy requests, a caller-timed stream, and concurrent streams.

Every figure is timed by the caller, the way a client sees it.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import time
from collections.abc import Callable

from tokenspout.v1 import generation_pb2 as pb

PROMPTS = ["Water boils at", "The moon is", "Cats are", "Rain falls", "Trees grow", "Rivers run", "Bread is", "Snow is"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants so far (a server's engine process and front
    ends, those that ended included), every thread (Linux /proc)."""
    return sum(_own_and_reaped_cpu(process) for process in [pid, *descendants(pid)])


def descendants(pid: int) -> list[int]:
    children = []
    try:
        tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # the process ended meanwhile: its parent's reaped time holds it
        return []
    for task in tasks:
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return [found for child in children for found in (child, *descendants(child))]


def _own_and_reaped_cpu(pid: int) -> float:
    """Its own CPU time, and that of the children it has waited for (stat fields 14-17)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # it ended meanwhile: its parent's reaped time holds it
        return 0.0
    return sum(int(field) for field in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def settle(stub) -> None:
    """Waits until the server has computed again every answer it will (with prefix_cache_exact it does so
    when idle): what runs next on the machine is then not slowed by this server's leftovers."""
    if stub.GetModelInfo(pb.GetModelInfoRequest()).prefix_reuse != pb.PREFIX_REUSE_EXACT:
        return  # it computes no answer again
    last = -1
    while (now := stub.GetServerStatus(pb.GetServerStatusRequest()).retiled_tokens_total) != last:
        last = now
        time.sleep(1.0)


def greedy_request(prompt: str, tokens: int) -> pb.GenerateStreamRequest:
    """`tokens` greedy tokens, never cut short by an end-of-generation token."""
    return pb.GenerateStreamRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
    )


def timed_stream(stub, prompt: str, tokens: int) -> tuple[float, float]:
    """One greedy stream: (seconds to the first message, decode tokens/s after it)."""
    return timed_request(stub, greedy_request(prompt, tokens))[:2]


def timed_request(stub, request: pb.GenerateStreamRequest) -> tuple[float, float, pb.GenerateStreamResponse]:
    """One stream that must run to max_new_tokens: (seconds to the first message, decode tokens/s
    after it, the last message)."""
    tokens = request.stopping.max_new_tokens
    start = time.perf_counter()
    first = last = None
    for message in stub.GenerateStream(request, timeout=300):
        last = time.perf_counter()
        first = first or last
        final = message
    assert final.generated_tokens == tokens, f"{final.generated_tokens} of {tokens} tokens: {final.finish}"
    return first - start, decode_rate(start, [first, last], tokens), final


def decode_rate(start: float, arrivals: list[float], tokens: int) -> float:
    """Tokens/s after a stream's first message, from its messages' arrival times; the whole call's rate when
    it came in one message (a reader that falls behind gets every token that piled up in one)."""
    first, last = arrivals[0], arrivals[-1]
    return (tokens - 1) / (last - first) if last > first else tokens / (last - start)


def aggregate_rate(
    stub, streams: int, tokens: int, prompts: list[str] = PROMPTS, make_request: Callable = greedy_request
) -> float:
    """Tokens/s of `streams` concurrent streams (one per prompt; greedy unless `make_request`
    says otherwise), start to last token."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda p: timed_request(stub, make_request(p, tokens)), prompts[:streams]))
    return streams * tokens / (time.perf_counter() - start)
