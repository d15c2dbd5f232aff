"""The server's limits on one request: what GetModelInfo.limits reports and the edge's checks enforce."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_stop_sequences: int = 16
    max_stop_sequence_length: int = 256
    max_top_logprobs: int = 20
    max_logit_bias_entries: int = 1024
    max_request_id_length: int = 128
    max_cache_salt_length: int = 256
    max_choices: int = 1024
    max_constraint_chars: int = 1_000_000
    max_input_bytes: int = 1 << 20
    """A prompt, a chat's contents together, or Tokenize text (UTF-8); more is INVALID_ARGUMENT."""
    max_banned_strings: int = 64
    max_banned_string_length: int = 256
    max_dry_breakers: int = 16
    max_dry_breaker_length: int = 32
    max_samples: int = 16
    """Most samples (n) one request may ask for."""
    max_tokenize_texts: int = 64
    """Most texts one Tokenize call may carry (TokenizeRequest.texts)."""
