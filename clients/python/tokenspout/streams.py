"""What a stream of chunks keeps, the same for the sync and the asyncio client.

`Stream` and `AsyncStream` differ only in how they wait (next() or await read());
the bookkeeping they share is here: the chunks so far, whether anything arrived
(only a call that received nothing may be retried), its tries (tokenspout.retry.Tries)
and cancellation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from tokenspout import responses as rs
from tokenspout.retry import Tries
from tokenspout.v1 import generation_pb2 as pb


class StreamState:
    def __init__(self, start: Callable[[float | None], Any], tries: Tries) -> None:
        self._start = start
        """Starts the call (again) with a timeout."""
        self._tries = tries
        self._call: Any = None
        self._received = False
        self._cancelled = False
        self._chunks: list[rs.Chunk] = []

    def _started(self) -> Any:
        """The call, started now if it has not been (or failed before anything arrived)."""
        if self._call is None:
            self._call = self._start(self._tries.timeout())
        return self._call

    def _wait_after(self, rpc_error: grpc.RpcError) -> float:
        """Seconds to wait before starting the call again; raises its error instead when something streamed
        already (never repeated), the caller left, or the retry policy says no."""
        wait = self._tries.wait_after(rpc_error, "the stream", may_retry=not (self._received or self._cancelled))
        self._call = None
        return wait

    def _accept(self, response: pb.GenerateStreamResponse) -> rs.Chunk | None:
        """The chunk a response carries, or None for a heartbeat."""
        self._received = True
        if response.heartbeat:
            return None
        chunk = rs.from_proto(rs.Chunk, response)
        self._chunks.append(chunk)
        return chunk

    @property
    def text(self) -> str:
        """The text received so far (of the first sample)."""
        return "".join(chunk.text for chunk in self._chunks if chunk.index == 0)

    @property
    def reasoning(self) -> str:
        """The reasoning received so far (of the first sample)."""
        return "".join(chunk.reasoning for chunk in self._chunks if chunk.index == 0)

    @property
    def tool_calls(self) -> list[rs.ToolCall]:
        """The first sample's calls as far as they have formed: complete ones, then the one still forming
        (its arguments cut short), assembled from the deltas."""
        return assemble(chunk for chunk in self._chunks if chunk.index == 0)

    @property
    def finish(self) -> rs.Finish | None:
        """How the generation (its first sample) ended, once its last chunk has arrived."""
        return next((chunk.finish for chunk in reversed(self._chunks) if chunk.index == 0 and chunk.finish), None)

    @property
    def retries(self) -> int:
        return self._tries.retries

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


def generation(chunks: Sequence[rs.Chunk]) -> rs.Generation:
    """The whole generation from its chunks: sample 0's, with every sample in `samples` when there are several."""
    by_sample: dict[int, list[rs.Chunk]] = {}
    for chunk in chunks:
        by_sample.setdefault(chunk.index, []).append(chunk)
    samples = [
        rs.Sample(index=index, text="".join(c.text for c in part), tokens=[t for c in part for t in c.tokens],
                  generated_tokens=part[-1].generated_tokens, finish=part[-1].finish,
                  reasoning="".join(c.reasoning for c in part), tool_calls=[t for c in part for t in c.tool_calls])
        for index, part in sorted(by_sample.items())
    ]
    first = by_sample.get(0, [rs.Chunk()])
    sample = samples[0] if samples else rs.Sample()
    return rs.Generation(
        request_id=first[0].request_id,
        text=sample.text,
        tokens=sample.tokens,
        generated_tokens=sample.generated_tokens,
        input_tokens=first[0].input_tokens,
        finish=sample.finish,
        prompt_tokens=first[0].prompt_tokens,
        truncated_input_tokens=first[0].truncated_input_tokens,
        samples=samples if len(samples) > 1 else [],
        reasoning=sample.reasoning,
        tool_calls=sample.tool_calls,
    )


def assemble(chunks: Iterable[rs.Chunk]) -> list[rs.ToolCall]:
    """Tool calls from streamed chunks: a call's first delta gives its id and name, later ones extend its arguments."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in chunk.tool_call_deltas:
            call = calls.setdefault(delta.index, [delta.id, delta.name, ""])
            call[2] += delta.arguments_delta
    return [rs.ToolCall(id=i, name=n, arguments=a) for i, n, a in (calls[index] for index in sorted(calls))]
