"""What a stream of chunks keeps, the same for the sync and the asyncio client.

`Stream` and `AsyncStream` differ only in how they wait (next() or await read());
the bookkeeping they share is here: the chunks so far, whether anything arrived
(only a call that received nothing may be retried), retries and cancellation.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tokenspout import responses as rs
from tokenspout.errors import TokenspoutError
from tokenspout.retry import RetryPolicy
from tokenspout.v1 import generation_pb2 as pb


class StreamState:
    def __init__(self, start: Callable[[float | None], Any], retry: RetryPolicy, deadline: float | None) -> None:
        self._start = start
        self._retry = retry
        self._deadline = deadline
        self._call: Any = None
        self._retries = 0
        self._received = False
        self._cancelled = False
        self._chunks: list[rs.Chunk] = []

    def _retry_delay(self, error: TokenspoutError) -> float | None:
        """Seconds to wait before starting the call again, or None to give up (raise)."""
        if self._received or self._cancelled:
            return None  # something streamed already (or the caller left): never repeat it
        wait = self._retry.delay(error, self._retries, self._deadline)
        if wait is not None:
            self._retries += 1
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
        """The text received so far."""
        return "".join(chunk.text for chunk in self._chunks)

    @property
    def finish(self) -> rs.Finish | None:
        """How the generation ended, once the last chunk has arrived."""
        return self._chunks[-1].finish if self._chunks else None

    @property
    def retries(self) -> int:
        return self._retries

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


def generation(chunks: Sequence[rs.Chunk]) -> rs.Generation:
    """The whole generation from its chunks."""
    last = chunks[-1] if chunks else rs.Chunk()
    return rs.Generation(
        request_id=last.request_id,
        text="".join(c.text for c in chunks),
        tokens=[t for c in chunks for t in c.tokens],
        generated_tokens=last.generated_tokens,
        input_tokens=chunks[0].input_tokens if chunks else 0,
        finish=last.finish,
    )
