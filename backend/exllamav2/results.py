"""exllamav2 result dicts -> the neutral TokenEvent / Finish.

The generator already holds back partial UTF-8 and partial stop strings, so
its `text` is passed through. Its quirks, as documented for 0.3.2: many
streaming results carry no `text` at all; a stop-token EOS carries no text,
and what was held then (say, a prefix that never became a stop string) is
only in `held`; usage counts come from `new_tokens`, not from summing ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backend.logprobs import with_logprobs
from backend.types import Finish, FinishReason, GeneratedToken, GenerationRequest, TokenEvent, Timings, Usage


class JobResults:
    """Translates one job's results, in order."""

    def __init__(self, request: GenerationRequest, eos_token_ids: frozenset[int], piece, vocab_size: int) -> None:
        self._request = request
        self._eos_token_ids = eos_token_ids
        self._piece = piece  # token id -> bytes
        self._vocab_size = vocab_size  # the logits are padded beyond it
        self.generated = 0
        self._deadline = request.end_by

    def deadline_passed(self, now: float) -> bool:
        return self._deadline is not None and now >= self._deadline

    def translate(self, result: dict[str, Any]) -> TokenEvent | None:
        """The event for one result dict, or None for results that carry nothing for the caller."""
        if result.get("stage") != "streaming":
            return None
        tokens = self._tokens(result)
        text = result.get("text", "")
        self.generated += len(tokens)
        if not result.get("eos"):
            return TokenEvent(tokens, text, self.generated)
        reason, stop_sequence, stop_token_id = self._reason(result)
        if reason in (FinishReason.EOS_TOKEN, FinishReason.STOP_TOKEN):
            text += self._held_text(result)
        if "new_tokens" in result:  # the generator's count; a healed job's starts at -1
            self.generated = result["new_tokens"] + self._request.sampling.token_healing
        finish = Finish(
            reason=reason,
            usage=Usage(result.get("prompt_tokens", len(self._request.prompt_token_ids)), self.generated,
                        result.get("cached_tokens", 0)),
            timings=self._timings(result),
            seed=self._request.sampling.seed,
            stop_sequence=stop_sequence,
            stop_token_id=stop_token_id,
        )
        return TokenEvent(tokens, text, self.generated, finish)

    def _tokens(self, result: dict[str, Any]) -> tuple[GeneratedToken, ...]:
        ids = _first_row(result["token_ids"]) if "token_ids" in result else []
        suppressed = _first_row(result["suppressed_tokens"]) if "suppressed_tokens" in result else []
        if suppressed and ids[-len(suppressed) :] == suppressed:
            # 0.3.2 rewinds a banned string's text but not its token ids (a typo in rewind_checkpoint).
            ids = ids[: -len(suppressed)]
        if "logits" not in result:
            return tuple(GeneratedToken(int(t), self._piece(int(t))) for t in ids)
        rows = np.asarray(result["logits"], dtype=np.float32)[0, :, : self._vocab_size]  # (1, n, vocab)
        top_n = self._request.output.top_logprobs
        return tuple(with_logprobs(int(t), row, self._piece, top_n) for t, row in zip(ids, rows))

    def _reason(self, result: dict[str, Any]) -> tuple[FinishReason, str | None, int | None]:
        reason = result.get("eos_reason")
        if reason == "stop_token":
            token = int(result.get("eos_triggering_token_id", -1))
            if token in self._eos_token_ids and token not in self._request.stopping.stop_token_ids:
                return FinishReason.EOS_TOKEN, None, None
            return FinishReason.STOP_TOKEN, None, token
        if reason == "stop_string":
            return FinishReason.STOP_SEQUENCE, result.get("eos_triggering_string"), None
        if reason == "end_filter":
            return FinishReason.CONSTRAINT_COMPLETE, None, None
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
        return Timings(queue_s, queue_s + prefill_s, prefill_s, decode_s, queue_s + prefill_s + decode_s)


def _first_row(value: Any) -> list:
    """Result tensors have shape (1, n); fakes may pass nested lists."""
    rows = value.tolist() if hasattr(value, "tolist") else value
    return list(rows[0])
