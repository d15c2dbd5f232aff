"""Prefix reuse in the llama.cpp core with prefix_cache_exact: the same greedy output as a cold run, fewer tokens
computed, and no live request ever refused or disturbed for it (reuse to the token, the default, is
test_token_reuse.py's). Driven step by step on the real model; the gRPC checks at the end."""

from __future__ import annotations

import grpc
import llama_cpp
import pytest

from backend.constraints import ConstraintCompiler, ConstraintSpec
from backend.events import FinishReason
from backend.llamacpp.layout import TILE_ROWS
from backend.llamacpp.slots import MIN_REUSE_TOKENS
from backend.types import ChatMessage, GenerationRequest, SamplingParams, StopParams
from tests.harness.core_driver import Recorder, make_core, run_until_idle, token_ids
from tests.harness.helpers import greedy, stream
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SYSTEM = (
    "You are a careful assistant for a hardware shop. Answer in one short paragraph, name the aisle where "
    "the item is found, and never invent prices. The shop sells tools, paint, garden supplies and timber."
)
QUESTIONS = ["Where are the hammers?", "Do you sell blue paint?", "What is the best saw for timber?"]


def run(core, model, request_id: str, tokens, max_new_tokens: int = 16, constraint=None, last_message_start=0) -> Recorder:
    rec = Recorder(core)
    stopping = StopParams(max_new_tokens=max_new_tokens, ignore_eos=constraint is None)
    core.add(GenerationRequest(request_id, tuple(tokens), SamplingParams(temperature=0.0), stopping,
                               constraint=constraint.spec if constraint else None,
                               last_message_start=last_message_start), rec, *([constraint] if constraint else []))
    run_all(core)
    return rec


def run_all(core) -> None:
    run_until_idle(core, after_step=check_cells)


def check_cells(core) -> None:
    """What the core believes each slot holds is what llama.cpp's cache holds."""
    inner = core.core
    memory = llama_cpp.llama_get_memory(inner.ctx)
    live = {seq.slot: seq for seq in inner.scheduler.running.values()}
    prefixes = inner.slots.prefixes
    for slot in range(inner.slots.count):
        held = llama_cpp.llama_memory_seq_pos_max(memory, slot) + 1
        if slot in live:
            assert held == live[slot].cached, (slot, held, live[slot].cached)
        elif slot in prefixes:
            assert held == len(prefixes._entries[slot].tokens), slot
        else:
            assert held == 0, slot


@pytest.fixture
def cores(model):
    """The same settings with and without prefix reuse."""
    with_reuse = make_core(model, context_length=512, max_batch_size=3, batch_tokens=512, prefix_cache_exact=True)
    without = make_core(model, context_length=512, max_batch_size=3, batch_tokens=512, prefix_cache=False,
                      prefix_cache_exact=True)
    yield with_reuse, without
    with_reuse.close()
    without.close()


def chat_tokens(model, *turns: str, system: str = SYSTEM) -> tuple[list[int], int]:
    """A chat's tokens, and where its last message starts (as the service finds it)."""
    roles = ["user", "assistant"] * len(turns)
    messages = [ChatMessage("system", system)] + [ChatMessage(role, text) for role, text in zip(roles, turns)]
    tokens, history = model.render_chat(messages), model.render_chat(messages[:-1], False)
    assert tokens[: len(history)] == history
    return tokens, len(history)


def test_greedy_output_is_identical_with_and_without_reuse_for_prompts(cores, model):
    with_reuse, without = cores
    for i, question in enumerate(QUESTIONS):
        tokens = model.tokenize(SYSTEM + "\nQuestion: " + question + "\nAnswer:")
        reused, fresh = run(with_reuse, model, f"r{i}", tokens, 24), run(without, model, f"f{i}", tokens, 24)
        assert token_ids(reused) == token_ids(fresh), question
        assert fresh.finish.usage.cached_tokens == 0
        if i > 0:  # the shared instructions came from the cache
            assert reused.finish.usage.cached_tokens >= len(model.tokenize(SYSTEM)) - 1
    assert with_reuse.stats.cached_prompt_tokens_total > 0 and without.stats.cached_prompt_tokens_total == 0


def test_greedy_output_is_identical_with_and_without_reuse_for_a_multi_turn_chat(cores, model):
    """Each turn resends the history, the model's own earlier answers (computed while decoding) included."""
    with_reuse, without = cores
    turns: list[str] = []
    for i, question in enumerate(QUESTIONS):
        tokens, start = chat_tokens(model, *turns, question, system=SYSTEM * 2)
        reused = run(with_reuse, model, f"r{i}", tokens, 20, last_message_start=start)
        fresh = run(without, model, f"f{i}", tokens, 20, last_message_start=start)
        assert token_ids(reused) == token_ids(fresh), question
        if i > 0:  # the history came from the cache, but for the rows of the last tile before this message
            assert reused.finish.usage.cached_tokens >= start - TILE_ROWS
        answer = b"".join(model.pieces[t] for t in token_ids(reused)).decode("utf-8", "replace")
        turns += [question, answer]


def test_the_same_history_with_a_new_question_computes_only_the_question(cores, model):
    """The workload of an app with one system prompt: everything before the last message is reused."""
    with_reuse, without = cores
    for i, question in enumerate(QUESTIONS):
        tokens, start = chat_tokens(model, question, system=SYSTEM * 3)
        assert start >= TILE_ROWS
        reused = run(with_reuse, model, f"r{i}", tokens, 16, last_message_start=start)
        fresh = run(without, model, f"f{i}", tokens, 16, last_message_start=start)
        assert token_ids(reused) == token_ids(fresh), question
        if i > 0:  # the history, and the last message's opening tokens it shares with the one before
            assert start <= reused.finish.usage.cached_tokens <= len(tokens) - 2
        else:
            assert reused.finish.usage.cached_tokens == 0


def test_a_prompt_longer_than_a_batch_is_identical_with_and_without_reuse(model):
    with_reuse = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128, prefix_cache_exact=True)
    without = make_core(model, context_length=512, max_batch_size=2, batch_tokens=128, prefix_cache=False,
                      prefix_cache_exact=True)
    try:
        for i, question in enumerate(QUESTIONS):
            tokens, start = chat_tokens(model, question, system=SYSTEM * 7)
            assert len(tokens) > 2 * 128
            for last_message_start in (start, 0):  # a chat, and the same tokens as a plain prompt
                reused = run(with_reuse, model, f"r{i}-{last_message_start}", tokens, 12,
                             last_message_start=last_message_start)
                fresh = run(without, model, f"f{i}-{last_message_start}", tokens, 12,
                            last_message_start=last_message_start)
                assert token_ids(reused) == token_ids(fresh), (question, last_message_start)
        assert with_reuse.stats.cached_prompt_tokens_total > 0
    finally:
        with_reuse.close()
        without.close()


def test_a_prompt_computes_the_same_beside_other_streams_as_alone(model):
    """Each prompt group goes in a llama_decode of its own, so what else runs cannot regroup its rows."""
    busy = make_core(model, context_length=512, max_batch_size=4, batch_tokens=512, prefix_cache=False)
    alone = make_core(model, context_length=512, max_batch_size=1, batch_tokens=512, prefix_cache=False)
    try:
        tokens, start = chat_tokens(model, QUESTIONS[0], system=SYSTEM * 2)
        background = [Recorder(busy) for _ in range(3)]
        for i, rec in enumerate(background):
            busy.add(GenerationRequest(f"bg{i}", tuple(model.tokenize(f"Story {i}: once upon a time")),
                                       SamplingParams(temperature=0.0), StopParams(max_new_tokens=60, ignore_eos=True)), rec)
        for _ in range(4):
            busy.step()
        assert busy.stats.running_sequences == 3 and all(rec.events for rec in background)  # all three decoding
        beside = run(busy, model, "beside", tokens, 24, last_message_start=start)
        assert token_ids(beside) == token_ids(run(alone, model, "alone", tokens, 24, last_message_start=start))
    finally:
        busy.close()
        alone.close()


def test_greedy_output_is_identical_with_and_without_reuse_when_constrained(cores, model):
    with_reuse, without = cores
    compiled = ConstraintCompiler(model.constraint_tokenizer()).compile(
        ConstraintSpec("json_schema", '{"type":"object","properties":{"aisle":{"type":"integer"},'
                                      '"item":{"type":"string","maxLength":12}},"required":["aisle","item"]}')
    )
    for i, question in enumerate(QUESTIONS):
        tokens = model.tokenize(SYSTEM + "\nReply in JSON. " + question + "\n")
        reused = run(with_reuse, model, f"r{i}", tokens, 40, compiled)
        fresh = run(without, model, f"f{i}", tokens, 40, compiled)
        assert token_ids(reused) == token_ids(fresh), question
        assert reused.finish.reason is fresh.finish.reason
        if i > 0:
            assert reused.finish.usage.cached_tokens > 0


def test_a_burst_sharing_a_prefix_computes_it_once(model):
    core = make_core(model, context_length=512, max_batch_size=4, batch_tokens=512, prefix_cache_exact=True)
    try:
        prompts = [model.tokenize(SYSTEM + " " + SYSTEM + "\nQuestion: " + q) for q in QUESTIONS]
        recs = [Recorder(core) for _ in prompts]
        for i, (tokens, rec) in enumerate(zip(prompts, recs)):
            core.add(GenerationRequest(f"b{i}", tuple(tokens), SamplingParams(temperature=0.0),
                                       StopParams(max_new_tokens=8, ignore_eos=True)), rec)
        run_all(core)
        # The first computes the shared part; the others wait for it and copy it.
        assert [rec.finish.usage.cached_tokens >= MIN_REUSE_TOKENS for rec in recs] == [False, True, True]
        shared = len(model.tokenize(SYSTEM + " " + SYSTEM + "\nQuestion:"))
        assert core.stats.cached_prompt_tokens_total >= 2 * (shared - TILE_ROWS)
        solo = make_core(model, context_length=512, max_batch_size=1, batch_tokens=512, prefix_cache=False,
                             prefix_cache_exact=True)
        try:
            for i, tokens in enumerate(prompts):
                assert token_ids(recs[i]) == token_ids(run(solo, model, f"s{i}", tokens, 8))
        finally:
            solo.close()
    finally:
        core.close()


def test_eviction_under_pressure_never_fails_a_live_request(model):
    """Two slots and one spare stream, twelve requests with different long prefixes arriving in waves."""
    core = make_core(model, context_length=256, max_batch_size=2, prefix_cache_slots=1)
    try:
        recs = {}
        for wave in range(4):
            for j in range(3):
                i = wave * 3 + j
                tokens = model.tokenize(f"Story number {i}: " + SYSTEM.replace("shop", f"shop {i}"))
                recs[i] = Recorder(core)
                core.add(GenerationRequest(f"e{i}", tuple(tokens), SamplingParams(temperature=0.0),
                                           StopParams(max_new_tokens=6 + i % 4, ignore_eos=True)), recs[i])
            for _ in range(5):
                core.step()
                check_cells(core)
        run_all(core)
        for i, rec in recs.items():
            assert rec.finish is not None and rec.finish.reason is FinishReason.MAX_TOKENS, (i, rec.events[-1])
        assert len(core.slots.prefixes) <= core.slots.count
        assert core.stats.prefix_cache_entries == len(core.slots.prefixes) > 0
    finally:
        core.close()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "to-the-token"])
def test_cancelling_during_a_cached_prefix_copy(model, exact):
    core = make_core(model, context_length=512, max_batch_size=2, batch_tokens=64, prefix_cache_exact=exact)
    try:
        tokens = model.tokenize(SYSTEM + "\nQuestion: " + QUESTIONS[0])
        first = run(core, model, "first", tokens, 8)
        # "a" takes the cached prefix: the stream copy is queued in llama.cpp, to run at the next decode.
        core.add(GenerationRequest("a", tuple(model.tokenize(SYSTEM + "\nQuestion: " + QUESTIONS[1])),
                                   SamplingParams(temperature=0.0), StopParams(8, ignore_eos=True)), Recorder(core))
        inner = core.core
        inner.admitter.admit(inner.steps)
        assert inner.scheduler.running["a"].cached > 16
        core.cancel("a")  # before llama.cpp has copied anything
        check_cells(core)
        again = run(core, model, "again", tokens, 8)
        assert again.finish.usage.cached_tokens > 16
        if exact:  # to the token, the last prompt row computed alone may part from the cold run at a near tie
            assert token_ids(again) == token_ids(first)
        # Cancelled while waiting for a neighbour to compute the shared prefix, then mid-prefill after its copy.
        long_prompt = model.tokenize(SYSTEM * 3)
        leader, waiter, late = Recorder(core), Recorder(core), Recorder(core)
        greedy, eight = SamplingParams(temperature=0.0), StopParams(8, ignore_eos=True)
        core.add(GenerationRequest("leader", tuple(long_prompt), greedy, eight), leader)
        core.add(GenerationRequest("waiter", tuple(long_prompt) + (13,), greedy, eight), waiter)
        core.step()
        assert inner.scheduler.running["waiter"].place.needs_prefix
        core.cancel("waiter")
        check_cells(core)
        more = tuple(model.tokenize(" more words to read here " * 8, add_special=False))
        core.add(GenerationRequest("late", tuple(long_prompt[:-4]) + more, greedy, eight), late)
        for _ in range(6):
            core.step()
            check_cells(core)
        if "late" in inner.scheduler.running:
            core.cancel("late")
        run_all(core)
        assert leader.finish.reason is FinishReason.MAX_TOKENS
        assert waiter.finish.reason is FinishReason.CANCELLED
        solo = make_core(model, context_length=512, max_batch_size=1, prefix_cache=False,
                             prefix_cache_exact=exact)
        try:
            if exact:
                assert token_ids(leader) == token_ids(run(solo, model, "solo", long_prompt, 8))
        finally:
            solo.close()
        assert core.stats.cache_tokens_used == 0
    finally:
        core.close()


def test_the_setting_turns_reuse_off(model):
    core = make_core(model, context_length=512, prefix_cache=False)
    try:
        tokens = model.tokenize(SYSTEM + "\nQuestion: " + QUESTIONS[0])
        run(core, model, "a", tokens, 4)
        second = run(core, model, "b", tokens, 4)
        assert second.finish.usage.cached_tokens == 0 and core.stats.prefix_cache_entries == 0
        assert core.slots.count == 2  # no spare cache streams either
    finally:
        core.close()


# -- through gRPC


def test_a_second_request_with_the_same_system_prompt_reports_cached_tokens(stub):
    def ask(question: str) -> list[pb.GenerateStreamResponse]:
        request = pb.GenerateStreamRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="system", content=SYSTEM),
                                   pb.ChatMessage(role="user", content=question)]),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=8),
        )
        return stream(stub, request)

    shared = stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="system", content=SYSTEM)],
                                                            add_generation_prompt=False))).count
    before = stub.GetServerStatus(pb.GetServerStatusRequest())
    ask(QUESTIONS[0])
    second = ask(QUESTIONS[1])
    assert second[-1].finish.usage.cached_tokens >= shared - 2  # the system turn's closing tokens may differ
    status = stub.GetServerStatus(pb.GetServerStatusRequest())
    assert status.cached_prefixes >= 1 and status.cached_prefix_tokens >= shared - 2
    assert status.prefix_cache_hit_rate > 0
    assert status.cached_prompt_tokens_total - before.cached_prompt_tokens_total >= shared - 2


def test_the_service_keeps_a_chat_history_reusable_whatever_the_question(stub):
    """The service tells the engine where the last message starts: a history whose length is no
    multiple of a tile is reused whole, even when the two questions' prompts would be tiled
    differently as plain prompts (they end in different tiles here)."""
    system = SYSTEM * 4

    def ask(question: str) -> pb.GenerateStreamResponse:
        request = pb.GenerateStreamRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="system", content=system),
                                   pb.ChatMessage(role="user", content=question)]),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=2),
        )
        return stream(stub, request)[-1]

    history = stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="system", content=system)],
                                                             add_generation_prompt=False))).count
    assert history % TILE_ROWS > 16
    short, long_ = ask("Hammers?"), ask("Which aisle holds " + ", ".join(["the blue paint"] * 12) + "?")
    assert (short.finish.usage.prompt_tokens - 2) // TILE_ROWS != (long_.finish.usage.prompt_tokens - 2) // TILE_ROWS
    assert long_.finish.usage.cached_tokens >= history


def test_a_prompt_sent_again_through_grpc_computes_only_its_last_token(stub):
    prompt = SYSTEM + "\nQuestion: " + QUESTIONS[2] + "\nAnswer (in French):"
    stream(stub, greedy(prompt, max_new_tokens=24))
    usage = stream(stub, greedy(prompt, max_new_tokens=24))[-1].finish.usage
    assert usage.cached_tokens == usage.prompt_tokens - 1  # its logits give the first token


def test_greedy_output_through_grpc_is_the_same_cold_and_cached_with_prefix_cache_exact(tmp_path, model_path):
    server = start_server(tmp_path, "--context-length", "512", "--max-batch-size", "2", "--prefix-cache-exact")
    try:
        with grpc.insecure_channel(server.address) as channel:
            exact = pb_grpc.GenerationServiceStub(channel)
            assert exact.GetModelInfo(pb.GetModelInfoRequest()).prefix_reuse == pb.PREFIX_REUSE_EXACT
            assert exact.GetServerStatus(pb.GetServerStatusRequest()).prefix_reuse == pb.PREFIX_REUSE_EXACT
            prompt = SYSTEM + "\nQuestion: " + QUESTIONS[2] + "\nAnswer (in French):"
            first = stream(exact, greedy(prompt, max_new_tokens=24))
            again = stream(exact, greedy(prompt, max_new_tokens=24))
            assert [t.id for m in first for t in m.tokens] == [t.id for m in again for t in m.tokens]
            usage = again[-1].finish.usage
            assert usage.cached_tokens == usage.prompt_tokens - 2  # a prompt row is never computed alone
    finally:
        assert stop_server(server) == 0, server.log()
