"""Prefix reuse to the token (the default; prefix_cache_exact off), on the real model: a prompt computes only the
tokens no stream holds, counted in the rows llama.cpp's batch is handed, whichever slot holds them, and the
least recently used prefix goes first when a stream must be overwritten."""

from __future__ import annotations

from collections import Counter

import pytest

from backend.llamacpp.slots import MIN_COPY_TOKENS
from backend.types import GenerationRequest, SamplingParams, StopParams
from tests.backend.llamacpp.test_prefix_cache import SYSTEM, check_cells, run_all
from tests.harness.core_driver import Recorder, make_core, token_ids

STORY = "Once upon a time, in a village by the sea, there lived an old fisherman who"


class Rows:
    """Every row handed to llama_decode, read from llama.cpp's batch itself: (slot, position, token)."""

    def __init__(self, core) -> None:
        self.rows: list[tuple[int, int, int]] = []
        batch = core.core.batch
        decode = batch.decode

        def logged(ctx):
            raw = batch._batch
            self.rows += [(raw.seq_id[i][0], raw.pos[i], raw.token[i]) for i in range(raw.n_tokens)]
            return decode(ctx)

        batch.decode = logged

    def take(self) -> list[tuple[int, int, int]]:
        rows, self.rows = self.rows, []
        return rows


def run(core, request_id: str, tokens, max_new_tokens: int = 8, salt: str = "") -> Recorder:
    rec = Recorder(core)
    core.add(GenerationRequest(request_id, tuple(tokens), SamplingParams(temperature=0.0),
                               StopParams(max_new_tokens=max_new_tokens, ignore_eos=True), cache_salt=salt), rec)
    run_all(core)
    return rec


def prompt_rows(rows: list[tuple[int, int, int]], prompt: list[int]) -> list[int]:
    """The positions of `prompt`'s tokens computed (its sequence's decoded rows lie past them; another sequence's
    rows hold other tokens there)."""
    return sorted(position for _, position, token in rows if position < len(prompt) and token == prompt[position])


@pytest.fixture
def core(model):
    core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=512, prefix_cache_slots=2)
    assert not core.slots.exact
    yield core
    core.close()


def test_a_prompt_extending_a_cached_one_computes_only_its_new_tokens(core, model):
    rows = Rows(core)
    first = model.tokenize(STORY)
    assert len(first) < 64  # shorter than a tile: prefix_cache_exact would compute it all again
    run(core, "a", first)
    assert prompt_rows(rows.take(), first) == list(range(len(first)))
    more = model.tokenize(" caught a silver fish every morning", add_special=False)
    extended = first + more
    rec = run(core, "b", extended)
    assert rec.finish.usage.cached_tokens == len(first)  # exactly what was reused
    assert prompt_rows(rows.take(), extended) == list(range(len(first), len(extended)))
    again = run(core, "c", extended)  # the same prompt: only its last token, whose logits give the first token
    assert again.finish.usage.cached_tokens == len(extended) - 1
    assert prompt_rows(rows.take(), extended) == [len(extended) - 1]
    short = model.tokenize("Hi there, friend")  # to the token: even a prompt of a few tokens
    assert len(short) == MIN_COPY_TOKENS
    run(core, "d", short)
    rows.take()
    assert run(core, "e", short + more).finish.usage.cached_tokens == len(short)
    assert prompt_rows(rows.take(), short + more) == list(range(len(short), len(short + more)))
    assert core.stats.retiled_tokens_total == 0  # answers are kept as decoded, never computed again


def test_a_prompt_continuing_an_answer_takes_its_decoded_cells(core, model):
    rows = Rows(core)
    first = model.tokenize(STORY)
    answer = token_ids(run(core, "a", first, max_new_tokens=12))
    follow = [*first, *answer, *model.tokenize(" The end.", add_special=False)]
    rows.take()
    rec = run(core, "b", follow)
    # Every cell the first sequence computed: its prompt and its answer but for the last token, never fed.
    assert rec.finish.usage.cached_tokens == len(first) + len(answer) - 1
    assert prompt_rows(rows.take(), follow) == list(range(len(first) + len(answer) - 1, len(follow)))


def test_reuse_across_slots_copies_from_the_stream_that_holds_it(core, model):
    rows = Rows(core)
    long_prompt = model.tokenize(SYSTEM + " " + STORY)
    holder = run(core, "holder", long_prompt, max_new_tokens=40)
    slots = core.slots
    (held_at,) = [slot for slot, entry in slots.prefixes._entries.items() if entry.owner == "holder"]
    kept = slots.prefixes.get(held_at).tokens
    assert len(kept) == len(long_prompt) + 40 - 1
    # Keeps under half of what that stream holds: copied into another stream, the holder's entry left whole.
    branch = long_prompt[:30] + model.tokenize(" and a question about paint", add_special=False)
    rows.take()
    rec = run(core, "branch", branch)
    assert rec.finish.usage.cached_tokens == 30
    computed = rows.take()
    assert prompt_rows(computed, branch) == list(range(30, len(branch)))
    assert {slot for slot, _, _ in computed} != {held_at}  # it ran in another stream
    assert slots.prefixes.get(held_at).tokens == kept
    # A running sequence's cells are offered too: a request arriving while it decodes copies them.
    runner = Recorder(core)
    core.add(GenerationRequest("runner", tuple(long_prompt), SamplingParams(temperature=0.0),
                               StopParams(max_new_tokens=30, ignore_eos=True)), runner)
    while not runner.events:
        core.step()
    for _ in range(3):
        core.step()
    live = core.scheduler.running["runner"]
    cells = live.cached
    assert cells > len(long_prompt)  # its prompt and some of its answer
    beside = [*live.tokens[:cells], *model.tokenize(" Then", add_special=False)]
    rows.take()
    late = run(core, "late", beside)
    assert late.finish.usage.cached_tokens == cells
    assert prompt_rows(rows.take(), beside) == list(range(cells, len(beside)))
    assert runner.finish is not None and len(token_ids(holder)) == 40


def test_a_short_shared_prefix_in_another_stream_is_computed_rather_than_copied(core, model):
    first = model.tokenize(SYSTEM)
    run(core, "a", first, max_new_tokens=40)
    tiny = first[: MIN_COPY_TOKENS - 1] + model.tokenize(" nothing else in common here at all", add_special=False)
    assert run(core, "b", tiny).finish.usage.cached_tokens == 0  # a copy would cost more than it saves


def test_the_least_recently_used_prefix_is_evicted_first(model):
    """Three streams (a batch of one and two that only keep prefixes), five prompts that share nothing."""
    core = make_core(model, context_length=256, max_batch_size=1, batch_tokens=256, prefix_cache_slots=2)
    try:
        prompts = [model.tokenize(f"{word} " + STORY) for word in ("Apples", "Bridges", "Candles", "Dolphins", "Engines")]
        assert len({p[0] for p in prompts}) == len(prompts)  # nothing in common, not even a first token
        extra = model.tokenize(" and so on", add_special=False)
        for i in range(3):
            run(core, f"p{i}", prompts[i])
        assert len(core.slots.prefixes) == 3
        assert run(core, "p0+", prompts[0] + extra).finish.usage.cached_tokens == len(prompts[0])  # p0 used last now
        run(core, "p3", prompts[3])  # evicts the least recently used: p1
        run(core, "p4", prompts[4])  # then p2
        held = Counter(entry.tokens[0] for entry in core.slots.prefixes._entries.values())
        assert held == Counter([prompts[0][0], prompts[3][0], prompts[4][0]])
        assert run(core, "p0 again", prompts[0] + extra).finish.usage.cached_tokens == len(prompts[0] + extra) - 1
        assert run(core, "p1 again", prompts[1]).finish.usage.cached_tokens == 0
        check_cells(core)
    finally:
        core.close()


def test_salts_keep_token_reuse_apart(core, model):
    tokens = model.tokenize(STORY)
    more = tokens + model.tokenize(" sang", add_special=False)
    assert run(core, "a1", tokens, salt="tenant-a").finish.usage.cached_tokens == 0
    assert run(core, "b1", more, salt="tenant-b").finish.usage.cached_tokens == 0  # a's cells unseen
    assert run(core, "u1", more).finish.usage.cached_tokens == 0  # nor by unsalted requests
    assert run(core, "a2", more, salt="tenant-a").finish.usage.cached_tokens == len(tokens)


def test_a_burst_sharing_a_prefix_computes_it_once(model):
    core = make_core(model, context_length=512, max_batch_size=4, batch_tokens=512)
    try:
        rows = Rows(core)
        shared = model.tokenize(SYSTEM + " " + SYSTEM + "\nQuestion:")
        prompts = [shared + model.tokenize(f" {q}", add_special=False) for q in ("Hammers?", "Paint?", "Saws?")]
        recs = [Recorder(core) for _ in prompts]
        for i, (tokens, rec) in enumerate(zip(prompts, recs)):
            core.add(GenerationRequest(f"b{i}", tuple(tokens), SamplingParams(temperature=0.0),
                                       StopParams(max_new_tokens=4, ignore_eos=True)), rec)
        run_all(core)
        # The first computes the shared part; the others wait for it and copy it, computing only their own.
        assert [rec.finish.usage.cached_tokens for rec in recs] == [0, len(shared), len(shared)]
        computed = Counter(position for _, position, token in rows.take()
                           if position < len(shared) and token == shared[position])
        assert computed == Counter(range(len(shared)))
    finally:
        core.close()
