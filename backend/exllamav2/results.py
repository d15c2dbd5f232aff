"""exllamav2 result dicts -> the neutral TokenEvent / Finish.

The generator already holds back partial UTF-8 and partial stop strings, so
its `text` is passed through. Its quirks, as 0.3.2's source shows them
(generator/dynamic.py, ExLlamaV2DynamicJob.receive_sample): while text is held,
results carry neither text nor token ids, and the held tokens come later with
their text; a stop-token EOS is emitted without what is held, so those tokens,
the stop token itself and their logits are only in `held`; a stop string is cut
from the text and reported in `eos_triggering_string`; usage counts come from
`new_tokens` (plus one for a healed job, which counts from -1); a banned-string
rewind leaves the suppressed ids in `token_ids`; and our grammar filter never
gives exllamav2 end tokens, so no job ends with its "end_filter": a finished
grammar allows only EOS, and the job ends as a stop-token EOS.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from backend.exllamav2.filter_core import GrammarFilterCore
from backend.exllamav2.jobs import heals
from backend.common.logprobs import with_logprobs
from backend.common.output import make_finish
from backend.types import ErrorEvent, ErrorKind, FinishReason, GeneratedToken, GenerationRequest, TokenEvent, Timings


class JobResults:
    """Translates one job's results, in order."""

    def __init__(
        self,
        request: GenerationRequest,
        eos_token_ids: frozenset[int],
        piece,
        vocab_size: int,
        constraint: GrammarFilterCore | None = None,
    ) -> None:
        self._request = request
        self._eos_token_ids = eos_token_ids
        self._piece = piece  # token id -> bytes
        self._vocab_size = vocab_size  # the logits are padded beyond it
        self._constraint = constraint
        self._mask_reported = 0.0
        self.generated = 0
        self.started_at: float | None = None  # the generator made the job active
        self._first_token_at: float | None = None
        self._deadline = request.end_by

    def deadline_passed(self, now: float) -> bool:
        return self._deadline is not None and now >= self._deadline

    def translate(self, result: dict[str, Any]) -> TokenEvent | ErrorEvent | None:
        """The event for one result dict, or None for results that carry nothing for the caller.

        An ErrorEvent means the job's constraint failed: the job must be ended.
        """
        if result.get("stage") != "streaming":
            return None
        constraint = self._constraint
        if constraint is not None and constraint.error:
            return ErrorEvent(f"the constraint failed: {constraint.error}", ErrorKind.CONSTRAINT_FAILED)
        tokens = self._tokens(result)
        text = result.get("text", "")
        self.generated += len(tokens)
        if tokens and self._first_token_at is None:
            self._first_token_at = time.monotonic()
        if not result.get("eos"):
            return TokenEvent(tokens, text, self.generated, mask_s=self._mask_since_last())
        reason, stop_sequence, stop_token_id = self._reason(result)
        if result.get("eos_reason") == "stop_token":
            text += self._held_text(result)
        if stop_sequence is not None and self._request.stopping.include_stop_sequence:
            text += stop_sequence  # exllamav2 cuts it (and anything after it in the same token)
        if constraint is not None and (
            (reason is FinishReason.EOS_TOKEN and constraint.satisfied) or constraint.complete
        ):
            # The mask path never yields exllamav2's own "end_filter": a finished grammar allows only EOS.
            reason = FinishReason.CONSTRAINT_COMPLETE
        if "new_tokens" in result:  # the generator's count; a healed job's starts at -1
            self.generated = result["new_tokens"] + heals(self._request)
        finish = make_finish(
            self._request,
            reason,
            self.generated,
            self._timings(result),
            cached_tokens=result.get("cached_tokens", 0),
            # With drafting on, the generator counts each job's checked draft tokens (dynamic.py:2074-2075).
            draft_tokens=result.get("accepted_draft_tokens", 0) + result.get("rejected_draft_tokens", 0),
            accepted_draft_tokens=result.get("accepted_draft_tokens", 0),
            prompt_tokens=result.get("prompt_tokens", len(self._request.prompt_token_ids)),
            stop_sequence=stop_sequence,
            stop_token_id=stop_token_id,
            constraint_satisfied=constraint.satisfied if constraint is not None else None,
        )
        return TokenEvent(tokens, text, self.generated, finish, mask_s=self._mask_since_last())

    def end(self, reason: FinishReason) -> TokenEvent:
        """The last event of a job ended from outside the generator (cancelled, out of time): timings
        as this side saw them, since the generator reports its own only at EOS."""
        now = time.monotonic()
        arrival = self._request.arrival_time
        started = self.started_at or now
        first = self._first_token_at or now
        timings = Timings(
            started - arrival, first - arrival, first - started, now - first, now - arrival,
            constraint_compile_s=self._request.constraint.fresh_compile_s if self._request.constraint else 0.0,
            constraint_mask_s=self._constraint.mask_s if self._constraint is not None else 0.0,
        )
        finish = make_finish(
            self._request, reason, self.generated, timings,
            constraint_satisfied=self._constraint.satisfied if self._constraint is not None else None,
        )
        return TokenEvent((), "", self.generated, finish, mask_s=self._mask_since_last())

    def _mask_since_last(self) -> float:
        if self._constraint is None:
            return 0.0
        total = self._constraint.mask_s
        delta, self._mask_reported = total - self._mask_reported, total
        return delta

    def _tokens(self, result: dict[str, Any]) -> tuple[GeneratedToken, ...]:
        """The tokens released with this result; at EOS also those still held (a stop-token EOS holds
        its stop token, and whatever a partial stop string held before it)."""
        ids = _first_row(result["token_ids"]) if "token_ids" in result else []
        suppressed = _first_row(result["suppressed_tokens"]) if "suppressed_tokens" in result else []
        if suppressed and ids[-len(suppressed) :] == suppressed:
            # 0.3.2 rewinds a banned string's text but not its token ids (a typo in rewind_checkpoint).
            ids = ids[: -len(suppressed)]
        rows = _rows(result.get("logits"), len(ids))
        held = (result.get("held") or {}) if result.get("eos") else {}
        if "token_ids" in held:
            held_ids = _first_row(held["token_ids"])
            ids, rows = ids + held_ids, rows + _rows(held.get("logits"), len(held_ids))
        top_n = self._request.output.top_logprobs
        return tuple(
            GeneratedToken(int(t), self._piece(int(t))) if row is None
            else with_logprobs(int(t), row[: self._vocab_size], self._piece, top_n)
            for t, row in zip(ids, rows)
        )

    def _reason(self, result: dict[str, Any]) -> tuple[FinishReason, str | None, int | None]:
        reason = result.get("eos_reason")
        if reason == "stop_token":
            token = int(result.get("eos_triggering_token_id", -1))
            if token in self._eos_token_ids and token not in self._request.stopping.stop_token_ids:
                return FinishReason.EOS_TOKEN, None, None
            return FinishReason.STOP_TOKEN, None, token
        if reason == "stop_string":
            return FinishReason.STOP_SEQUENCE, result.get("eos_triggering_string"), None
        return FinishReason.MAX_TOKENS, None, None

    @staticmethod
    def _held_text(result: dict[str, Any]) -> str:
        """Held text at a stop-token EOS, without the stop token's own piece."""
        held = (result.get("held") or {}).get("text", "")
        trigger = result.get("eos_triggering_token_str", "")
        return held[: -len(trigger)] if trigger and held.endswith(trigger) else held

    def _timings(self, result: dict[str, Any]) -> Timings:
        queue_s = float(result.get("time_enqueued", 0.0))
        prefill_s = float(result.get("time_prefill", 0.0))
        decode_s = float(result.get("time_generate", 0.0))
        compiled = self._request.constraint
        return Timings(
            queue_s, queue_s + prefill_s, prefill_s, decode_s, queue_s + prefill_s + decode_s,
            constraint_compile_s=compiled.fresh_compile_s if compiled is not None else 0.0,
            constraint_mask_s=self._constraint.mask_s if self._constraint is not None else 0.0,
        )


def _first_row(value: Any) -> list:
    """Result tensors have shape (1, n); fakes may pass nested lists."""
    rows = value.tolist() if hasattr(value, "tolist") else value
    return list(rows[0])


def _rows(logits: Any, count: int) -> list:
    """The n logit rows of a (1, n, padded vocabulary) tensor; `count` Nones where it is absent."""
    return [None] * count if logits is None else list(np.asarray(logits, dtype=np.float32)[0])
