"""The model's vocabulary, read once at load: every token's output text is what llama.cpp itself renders
without special tokens (control and unknown tokens as nothing), and the constraint engine's view keeps
the special tokens' text."""

from __future__ import annotations

import ctypes

import llama_cpp


def _llama_cpp_piece(model, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, special)
    assert n >= 0
    return buf.raw[:n]


def test_every_tokens_text_is_llama_cpps_own(model):
    assert model.pieces == [_llama_cpp_piece(model, t, special=False) for t in range(model.vocab_size)]
    assert model._special_pieces == [_llama_cpp_piece(model, t, special=True) for t in range(model.vocab_size)]
    hidden = [t for t in range(model.vocab_size) if model.pieces[t] != model._special_pieces[t]]
    assert hidden and all(model.pieces[t] == b"" for t in hidden), "control tokens render as nothing"
    assert set(model.eos_token_ids) <= set(hidden)
