"""Per-sequence output bookkeeping shared by every engine.

An engine samples a token; `SequenceOutput.on_token` decides whether that ends
the sequence (EOS, stop token, stop sequence, max tokens) and returns the event
to deliver: the safe text, the token and, on the last event, the Finish.
"""

from __future__ import annotations

from backend.common.clock import SequenceClock
from backend.common.text import StopSequenceFilter, Utf8Stream
from backend.constraints import CompiledConstraint, ConstraintState
from backend.events import Finish, FinishReason, GeneratedToken, Timings, TokenEvent, Usage
from backend.types import GenerationRequest


class ConstraintFailed(Exception):
    """The sequence's constraint matcher failed (llguidance's limits, or a token it rejects).

    The caller's constraint, not the engine, is at fault: the stream ends with that error.
    """


class SequenceOutput:
    def __init__(self, request: GenerationRequest, constraint: CompiledConstraint | None = None) -> None:
        """`constraint`: the request's constraint compiled by the engine."""
        self.request = request
        self._stopping = request.stopping
        self._utf8 = Utf8Stream()
        self._stops = StopSequenceFilter(request.stopping.stop_sequences, request.stopping.include_stop_sequence)
        # Read once: on_token runs for every token of every sequence.
        self._has_stops = any(request.stopping.stop_sequences)
        self._stop_token_ids = request.stopping.stop_token_ids
        self._max_new_tokens = request.stopping.max_new_tokens
        self._ignore_eos = request.stopping.ignore_eos
        self.cached_tokens = 0  # prompt tokens the engine took from its prefix cache
        self.prompt_tokens: tuple[GeneratedToken, ...] = ()  # prompt logprobs, for the next event
        self.draft_tokens = 0  # proposed tokens the engine checked (speculative decoding) ...
        self.accepted_draft_tokens = 0  # ... and the ones it accepted
        self.generated = 0
        self.finish: Finish | None = None
        self.clock = SequenceClock(request)
        self.step = 0  # set by the engine before each step's tokens
        self._accepted_draft = False
        self.constraint = ConstraintState(constraint) if constraint is not None else None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate before max_new_tokens."""
        return self._stopping.max_new_tokens - self.generated

    def mark_admitted(self) -> None:
        self.clock.admitted()

    @property
    def first_token_at(self) -> float | None:
        return self.clock.first_token_at

    def eos_allowed(self) -> bool:
        """End-of-generation tokens are masked until min_new_tokens, or always with ignore_eos."""
        return not self._stopping.ignore_eos and self.generated >= self._stopping.min_new_tokens

    def check_constraint(self) -> None:
        """Raises ConstraintFailed if the matcher has failed (e.g. computing this step's mask)."""
        if self.constraint is not None:
            failure = self.constraint.failure()
            if failure:
                raise ConstraintFailed(failure)

    def deadline_passed(self, now: float) -> bool:
        """The caller's deadline or the request's own time limit has passed."""
        return self.clock.deadline_passed(now)

    def on_token(self, token: GeneratedToken, is_eos: bool, accepted_draft: bool = False) -> TokenEvent:
        """Accounts for one generated token (sampled, forced by the grammar, or a proposed token that
        sampling agreed with: `accepted_draft`).

        Raises ConstraintFailed when the matcher has failed or rejects the token.
        """
        self._accepted_draft = accepted_draft
        self.accepted_draft_tokens += accepted_draft
        self.clock.first_token()
        self.generated += 1
        constraint_done = False
        if self.constraint is not None:
            self.check_constraint()
            if is_eos:
                # The mask allows EOS only where the grammar may end.
                if not self.constraint.satisfied:
                    raise ConstraintFailed("end of generation before the constraint was complete")
                return self._finish_event((token,), "", FinishReason.CONSTRAINT_COMPLETE)
            if not self.constraint.consume(token.token_id):
                raise ConstraintFailed(f"token {token.token_id} rejected: {self.constraint.failure()}")
            constraint_done = self.constraint.complete
        if is_eos and not self._ignore_eos:
            return self._finish_event((token,), "", FinishReason.EOS_TOKEN)
        if token.token_id in self._stop_token_ids:
            return self._finish_event((token,), "", FinishReason.STOP_TOKEN, stop_token_id=token.token_id)
        text = self._utf8.feed(token.piece)
        if self._has_stops:
            text = self._stops.push(text)
            if self._stops.matched is not None:
                stop = self._stops.matched.stop_sequence
                return self._finish_event((token,), text, FinishReason.STOP_SEQUENCE, stop_sequence=stop)
        if constraint_done:
            return self._finish_event((token,), text, FinishReason.CONSTRAINT_COMPLETE)
        if self.generated >= self._max_new_tokens:
            return self._finish_event((token,), text, FinishReason.MAX_TOKENS)
        return self._event((token,), text)

    def end(self, reason: FinishReason) -> TokenEvent:
        """Ends the sequence for a reason outside the token stream (time, context, cancel)."""
        return self._finish_event((), "", reason)

    def _finish_event(
        self,
        tokens: tuple[GeneratedToken, ...],
        text: str,
        reason: FinishReason,
        stop_sequence: str | None = None,
        stop_token_id: int | None = None,
    ) -> TokenEvent:
        if reason is not FinishReason.STOP_SEQUENCE:
            # Held text is real output unless a stop sequence cut it off.
            text += self._stops.push(self._utf8.flush())
            if self._stops.matched is not None:
                reason, stop_sequence = FinishReason.STOP_SEQUENCE, self._stops.matched.stop_sequence
            else:
                text += self._stops.flush()
        self.finish = make_finish(
            self.request,
            reason,
            self.generated,
            self.clock.timings(self._mask_s),
            cached_tokens=self.cached_tokens,
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
            stop_sequence=stop_sequence,
            stop_token_id=stop_token_id,
            constraint_satisfied=self.constraint.satisfied if self.constraint is not None else None,
        )
        return self._event(tokens, text)

    def _event(self, tokens: tuple[GeneratedToken, ...], text: str) -> TokenEvent:
        mask_s = self.clock.mask_delta(self._mask_s) if self.constraint is not None else 0.0
        accepted = int(self._accepted_draft and bool(tokens))
        prompt_tokens, self.prompt_tokens = self.prompt_tokens, ()
        return TokenEvent(tokens, text, self.generated, self.finish, self.step, mask_s, accepted,
                          self.request.sample_index, prompt_tokens)

    @property
    def _mask_s(self) -> float:
        return self.constraint.mask_s if self.constraint is not None else 0.0


def make_finish(
    request: GenerationRequest,
    reason: FinishReason,
    completion_tokens: int,
    timings: Timings,
    *,
    cached_tokens: int = 0,
    draft_tokens: int = 0,
    accepted_draft_tokens: int = 0,
    prompt_tokens: int | None = None,
    stop_sequence: str | None = None,
    stop_token_id: int | None = None,
    constraint_satisfied: bool | None = None,
) -> Finish:
    """The one place every engine builds a Finish (prompt_tokens defaults to the request's prompt)."""
    prompt = len(request.prompt_token_ids) if prompt_tokens is None else prompt_tokens
    return Finish(
        reason=reason,
        usage=Usage(prompt, completion_tokens, cached_tokens, draft_tokens, accepted_draft_tokens),
        timings=timings,
        seed=request.sampling.seed,
        stop_sequence=stop_sequence,
        stop_token_id=stop_token_id,
        constraint_satisfied=constraint_satisfied,
    )
