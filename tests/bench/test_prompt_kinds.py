"""The first-token benchmarks' prompts: fresh ones share not even a first token, extensions only extend."""

from __future__ import annotations

from bench.harness.prompt_kinds import extended, fresh_prompts


def test_fresh_prompts_share_nothing_and_extensions_extend_them(model, model_path):
    prompts = fresh_prompts(200, seed=7)
    tokens = [model.tokenize(prompt) for prompt in prompts]
    assert len({t[0] for t in tokens}) == len(prompts) == 200
    assert all(18 <= len(t) <= 24 for t in tokens)
    for i, (prompt, ids) in enumerate(zip(prompts, tokens)):
        longer = model.tokenize(extended(prompt, i))
        assert longer[: len(ids)] == ids and 4 <= len(longer) - len(ids) <= 7
