"""Generated tokens kept in the prefix cache, and cache salts, on the real model: with prefix_cache_exact a
chat's next turn computes only its new message, with the greedy output of a cold run (backend.llamacpp.retile);
to the token (the default) it takes the answer's cells as decoded and computes only what follows them; a
salted prompt never matches another salt's cells."""

from __future__ import annotations

import pytest

from backend.llamacpp.layout import TILE_ROWS
from backend.llamacpp.slots import MIN_REUSE_TOKENS
from backend.types import ChatMessage, GenerationRequest, SamplingParams, StopParams
from tests.backend.llamacpp.test_prefix_cache import QUESTIONS, SYSTEM, chat_tokens, check_cells, run_all
from tests.harness.core_driver import Recorder, make_core, request, token_ids


def turn_end(model) -> tuple[int, ...]:
    """What the template writes after an answer, up to the next message (as service.prompt finds it)."""
    asked = [ChatMessage("user", "Hi")]
    prompt = model.render_chat(asked)
    answered = model.render_chat([*asked, ChatMessage("assistant", "Hello")], False)
    return tuple(answered[len(prompt) + len(model.tokenize("Hello", add_special=False)):])


def run(core, request_id: str, tokens, start: int, ending=(), salt: str = "", max_new_tokens: int = 20,
        ignore_eos: bool = True) -> Recorder:
    rec = Recorder(core)
    core.add(GenerationRequest(request_id, tuple(tokens), SamplingParams(temperature=0.0),
                               StopParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
                               last_message_start=start, turn_end=tuple(ending), cache_salt=salt), rec)
    run_all(core)
    return rec


def answer_text(model, rec: Recorder) -> str:
    return b"".join(model.pieces[t] for t in token_ids(rec) if t not in model.eos_token_set).decode("utf-8", "replace")


@pytest.fixture
def cores(model):
    with_reuse = make_core(model, context_length=1024, max_batch_size=2, batch_tokens=512, prefix_cache_exact=True)
    without = make_core(model, context_length=1024, max_batch_size=2, batch_tokens=512, prefix_cache=False,
                      prefix_cache_exact=True)
    yield with_reuse, without
    with_reuse.close()
    without.close()


@pytest.mark.parametrize("system, ignore_eos", [(SYSTEM * 2, True), (SYSTEM * 2, False), ("Be brief.", True)],
                         ids=["tiled-cut-short", "tiled-own-ending", "shorter-than-a-tile"])
def test_the_next_turn_computes_only_its_message_with_the_output_of_a_cold_run(cores, model, system, ignore_eos):
    with_reuse, without = cores
    ending, turns = turn_end(model), []
    assert ending, "the embedded model's template closes an answer"
    for i, question in enumerate(QUESTIONS):
        tokens, start = chat_tokens(model, *turns, question, system=system)
        reused = run(with_reuse, f"r{i}", tokens, start, ending, ignore_eos=ignore_eos, max_new_tokens=24)
        fresh = run(without, f"f{i}", tokens, start, ending, ignore_eos=ignore_eos, max_new_tokens=24)
        assert token_ids(reused) == token_ids(fresh), question
        if i > 0:  # the whole history, the previous answer and the template around it included, came from the cache
            assert reused.finish.usage.cached_tokens == start, (question, start, len(tokens))
        turns += [question, answer_text(model, reused)]
    assert with_reuse.stats.retiled_tokens_total > 0


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "to-the-token"])
def test_without_the_setting_the_previous_answer_is_computed_again(model, exact):
    core = make_core(model, context_length=1024, max_batch_size=2, batch_tokens=512, prefix_cache_generated=False,
                     prefix_cache_exact=exact)
    try:
        ending = turn_end(model)
        tokens, start = chat_tokens(model, QUESTIONS[0], system=SYSTEM * 2)
        first = run(core, "a", tokens, start, ending)
        tokens, start = chat_tokens(model, QUESTIONS[0], answer_text(model, first), QUESTIONS[1], system=SYSTEM * 2)
        second = run(core, "b", tokens, start, ending)
        assert second.finish.usage.cached_tokens <= len(first.events) + start - 20 - 1
        assert core.stats.retiled_tokens_total == 0
    finally:
        core.close()


def test_salted_prompts_share_cells_only_within_their_salt(cores, model):
    with_reuse, _ = cores
    tokens, start = chat_tokens(model, QUESTIONS[0], system=SYSTEM * 3)
    assert start >= TILE_ROWS
    assert run(with_reuse, "a1", tokens, start, salt="tenant-a").finish.usage.cached_tokens == 0
    assert run(with_reuse, "b1", tokens, start, salt="tenant-b").finish.usage.cached_tokens == 0  # a's cells unseen
    assert run(with_reuse, "u1", tokens, start).finish.usage.cached_tokens == 0  # nor by unsalted requests
    again = chat_tokens(model, QUESTIONS[1], system=SYSTEM * 3)
    assert run(with_reuse, "a2", *again, salt="tenant-a").finish.usage.cached_tokens >= start
    assert run(with_reuse, "b2", *again, salt="tenant-b").finish.usage.cached_tokens >= start


def test_while_others_decode_an_answer_waits_until_its_next_turn_comes(cores, model):
    """The ended answer is not computed again while another stream decodes, only when its next turn arrives
    (which would compute those rows anyway): that turn then takes its whole history from the cache, with a
    cold run's output."""
    with_reuse, without = cores
    ending = turn_end(model)
    tokens, start = chat_tokens(model, QUESTIONS[0], system=SYSTEM * 2)
    first = Recorder(with_reuse)
    with_reuse.add(GenerationRequest("a", tuple(tokens), SamplingParams(temperature=0.0),
                                     StopParams(max_new_tokens=12, ignore_eos=True), last_message_start=start,
                                     turn_end=ending), first)
    busy = Recorder(with_reuse)
    with_reuse.add(request(model, "busy", "Count slowly from one to a hundred:", max_new_tokens=200), busy)
    while not first.events or first.finish is None:
        with_reuse.step()
    for _ in range(5):
        with_reuse.step()
    check_cells(with_reuse)
    assert with_reuse.core.slots.prefixes.ended(), "the answer waits while the other stream decodes"
    assert with_reuse.stats.retiled_tokens_total == 0

    next_turn, next_start = chat_tokens(model, QUESTIONS[0], answer_text(model, first), QUESTIONS[1],
                                        system=SYSTEM * 2)
    second = run(with_reuse, "b", next_turn, next_start, ending)  # the busy stream still decodes meanwhile
    assert second.finish.usage.cached_tokens == next_start
    assert token_ids(second) == token_ids(run(without, "cold", next_turn, next_start, ending))
    assert busy.finish is not None and not with_reuse.core.slots.prefixes.ended()


def test_a_short_prompt_stays_shared_when_every_free_slot_holds_a_prefix(cores, model):
    """A chat shorter than a tile whose answer makes it longer is computed again tiled, which a short prompt
    cannot take; its prompt's copy then takes the least recently used entry's slot when none is empty."""
    with_reuse, _ = cores
    slots = with_reuse.core.slots
    for i in range(slots.count):  # every slot ends up holding a prefix
        run(with_reuse, f"fill{i}", model.tokenize(f"Filler number {i}: " + "the quick brown fox " * 6), 0)
    assert len(slots.prefixes) == slots.count
    system = "You are a helpful assistant for a small bakery. Be brief and kind."
    tokens, start = chat_tokens(model, QUESTIONS[0], system=system)
    assert start >= MIN_REUSE_TOKENS and len(tokens) < TILE_ROWS
    run(with_reuse, "short", tokens, start, turn_end(model), max_new_tokens=40)
    assert with_reuse.stats.retiled_tokens_total > 0  # its answer made it longer than a tile: computed again tiled
    again, again_start = chat_tokens(model, QUESTIONS[1], system=system)
    assert run(with_reuse, "again", again, again_start).finish.usage.cached_tokens >= start - 2


def test_to_the_token_the_next_turn_computes_only_what_follows_the_answer(model):
    """The default: the answer's cells are taken as they were decoded, at once, with nothing computed again."""
    core = make_core(model, context_length=1024, max_batch_size=2, batch_tokens=512)
    try:
        ending, turns, previous = turn_end(model), [], 0
        for i, question in enumerate(QUESTIONS[:3]):
            tokens, start = chat_tokens(model, *turns, question, system=SYSTEM * 2)
            rec = run(core, f"d{i}", tokens, start, ending, max_new_tokens=20)
            check_cells(core)
            if i > 0:  # the history, the previous answer's cells included, but for the answer's last token
                assert previous + 19 - 2 <= rec.finish.usage.cached_tokens < start, (previous, start)
            previous = len(tokens)
            turns += [question, answer_text(model, rec)]
        assert core.stats.retiled_tokens_total == 0
        # A repeat of the first prompt takes its cells to the token too.
        tokens, start = chat_tokens(model, QUESTIONS[0], system=SYSTEM * 2)
        assert run(core, "again", tokens, start, ending).finish.usage.cached_tokens == len(tokens) - 1
    finally:
        core.close()
