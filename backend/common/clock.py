"""A sequence's clock: when it arrived, was admitted, finished its prompt and gave its first token, its
deadline, and the constraint-mask time it has reported. Every engine's per-sequence output keeps one, so
timings and deadlines are worked out in one place (backend.common.output, backend.exllama.results)."""

from __future__ import annotations

import time

from backend.events import Timings
from backend.types import GenerationRequest


class SequenceClock:
    def __init__(self, request: GenerationRequest) -> None:
        self._request = request
        self._deadline = request.end_by
        self.admitted_at: float | None = None
        """When the engine took it into its batch (the exllama generators: started its job)."""
        self.prefill_done_at: float | None = None
        self.first_token_at: float | None = None
        self._mask_reported = 0.0

    def admitted(self) -> None:
        self.admitted_at = time.monotonic()

    def first_token(self) -> None:
        """Its first token came now (once: later calls change nothing); the prompt is done by then too."""
        if self.first_token_at is None:
            now = time.monotonic()
            self.first_token_at = now
            self.prefill_done_at = self.prefill_done_at or now

    def deadline_passed(self, now: float) -> bool:
        """The caller's deadline or the request's own time limit has passed."""
        return self._deadline is not None and now >= self._deadline

    def mask_delta(self, mask_s: float) -> float:
        """Of `mask_s`, the constraint-mask time so far, what no event has reported yet (each event carries its own)."""
        delta, self._mask_reported = mask_s - self._mask_reported, mask_s
        return delta

    def timings(self, mask_s: float) -> Timings:
        """Its timings as of now; `mask_s`: its constraint-mask time in all."""
        now = time.monotonic()
        arrival = self._request.arrival_time
        admitted = self.admitted_at or now
        first = self.first_token_at or now
        return Timings(
            queue_s=admitted - arrival,
            time_to_first_token_s=first - arrival,
            prefill_s=(self.prefill_done_at or now) - admitted,
            decode_s=now - first,
            total_s=now - arrival,
            constraint_compile_s=self._request.constraint_compile_s,
            constraint_mask_s=mask_s,
        )
