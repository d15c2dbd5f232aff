"""bench.prompt_batching kept honest: both ways compute every prompt, to the same numbers, so its times
compare like with like (and the docs' claim that batching short prompts changes no output holds)."""

from __future__ import annotations

import llama_cpp
import numpy as np

from backend.llamacpp.batch import Batch
from bench.prompt_batching import BATCH_TOKENS, one_by_one, together


def test_both_ways_compute_every_prompt_to_the_same_logits(model) -> None:  # type: ignore[no-untyped-def]
    texts = ["Request 1: Why do cats purr?", "Request 2: The rules of chess are", "Request 3: Snow is white because"]
    prompts = [model.tokenize(text) for text in texts]
    ctx = model.new_context(len(prompts), 128, BATCH_TOKENS, 2)
    batch = Batch(BATCH_TOKENS)
    try:
        alone_done, alone_logits = one_by_one(model, ctx, batch, prompts)
        together_done, together_logits = together(model, ctx, batch, prompts)
        assert len(alone_done) == len(together_done) == len(prompts)
        assert alone_done == sorted(alone_done) and len(set(together_done)) == 1
        for a, b in zip(alone_logits, together_logits):
            assert a.shape == (model.vocab_size,) and np.isfinite(a).all()
            assert np.array_equal(a, b)
        assert not np.array_equal(alone_logits[0], alone_logits[1])  # three prompts, not one computed thrice
    finally:
        batch.free()
        llama_cpp.llama_free(ctx)
