"""The exllamav2 grammar filter's core on CPU, with llguidance and the real model's vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from backend.constraints import ConstraintCompiler
from backend.exllamav2.filter_core import GrammarFilterCore
from backend.types import ConstraintSpec


@pytest.fixture(scope="module")
def compiler(model):
    return ConstraintCompiler(model.constraint_tokenizer())


def allowed(core: GrammarFilterCore, padded: int) -> set[int]:
    logits = np.zeros(padded, dtype=np.float32)
    assert core.prepare_mask() is True
    return set(np.flatnonzero(np.isfinite(core.mask_logits(logits))).tolist())


def test_the_mask_follows_the_grammar_and_pads_past_the_vocabulary(model, compiler):
    padded = model.vocab_size + 64  # exllamav2's logits can be wider than the vocabulary
    core = GrammarFilterCore(compiler.compile(ConstraintSpec("regex", "[0-9]{3}")), model.eos_token_ids, model.vocab_size)
    core.begin()
    first = allowed(core, padded)
    assert first and all(model.pieces[t].decode().isdigit() for t in first)
    assert max(first) < model.vocab_size
    for token in model.tokenize("123", add_special=False):
        core.feed(token)
    assert core.complete
    assert allowed(core, padded) == set(model.eos_token_ids)  # complete: only EOS


def test_a_rejected_token_never_raises_and_leaves_only_eos(model, compiler):
    padded = model.vocab_size
    core = GrammarFilterCore(compiler.compile(ConstraintSpec("regex", "[0-9]+")), model.eos_token_ids, padded)
    core.begin()
    core.feed(model.tokenize("abc", add_special=False)[0])
    assert core.error
    assert allowed(core, padded) == set(model.eos_token_ids)
    core.feed(5)  # still no exception in the error state
    pass_tokens, end_tokens = core.allowed_tokens()
    assert set(pass_tokens) == set(model.eos_token_ids) and end_tokens == []


def test_begin_resets_for_the_first_sampling_step(model, compiler):
    core = GrammarFilterCore(compiler.compile(ConstraintSpec("choice", ("yes", "no"))), model.eos_token_ids,
                             model.vocab_size)
    core.feed(model.tokenize("x", add_special=False)[0])
    assert core.error
    core.begin()
    assert not core.error and allowed(core, model.vocab_size) - set(model.eos_token_ids)
