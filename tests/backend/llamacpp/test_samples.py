"""n samples of one prompt, on the real model: the prompt is computed once and shared.

Every sample forks from the first one's prompt cells (llama_memory_seq_cp) and
its last prompt row: the rows computed for n = 4 are about a quarter of four
separate requests', by Usage and by the engine's counters. Each sample has its
own seed, sampler and finish; the same seed alone reproduces a sample.
"""

from __future__ import annotations

import secrets

import grpc
import pytest

from tests.harness.helpers import bad_request_fields, error_reason, rpc_error, wait_for
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


def prompt_of(words: int) -> str:
    """A prompt no earlier request shares (so nothing comes from the prefix cache)."""
    return f"Note {secrets.token_hex(4)}: " + " ".join(f"stone{i}" for i in range(words)) + ". A short story:"


def sampled(prompt: str, n: int, seed: int | None = 7, max_new_tokens: int = 12, **fields) -> pb.GenerateStreamRequest:
    sampling = pb.SamplingParams(temperature=1.0, top_k=40)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateStreamRequest(
        prompt=prompt, n=n, sampling=sampling, output=pb.OutputOptions(return_token_ids=True),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True), **fields,
    )


def by_sample(messages) -> dict[int, list[pb.GenerateStreamResponse]]:
    samples: dict[int, list] = {}
    for message in messages:
        if not message.heartbeat:
            samples.setdefault(message.index, []).append(message)
    return samples


def ids(messages) -> list[int]:
    return [t.id for m in messages for t in m.tokens]


def test_four_samples_compute_the_prompt_once_and_each_is_its_own(stub):
    # 60 words are about 190 tokens: a lone sequence past 256 cached tokens takes llama.cpp's
    # split attention path and may part from its batched run (docs/benchmarks.md), so stay below.
    prompt = prompt_of(60)
    before = stub.GetServerStatus(pb.GetServerStatusRequest())
    samples = by_sample(stub.GenerateStream(sampled(prompt, 4, seed=1000), timeout=120))
    after = stub.GetServerStatus(pb.GetServerStatusRequest())
    assert sorted(samples) == [0, 1, 2, 3]
    length = samples[0][0].input_tokens
    for index, messages in samples.items():
        finish = messages[-1].finish
        assert messages[0].input_tokens == length and finish.reason == pb.FINISH_REASON_MAX_TOKENS
        assert finish.seed == 1000 + index and finish.usage.completion_tokens == 12 == len(ids(messages))
        assert sum(1 for m in messages if m.HasField("finish")) == 1
    usages = [samples[i][-1].finish.usage for i in range(4)]
    assert usages[0].cached_tokens == 0 and all(u.cached_tokens == length for u in usages[1:])
    computed_by_usage = sum(u.prompt_tokens - u.cached_tokens for u in usages)
    computed_by_engine = ((after.prompt_tokens_total - before.prompt_tokens_total)
                          - (after.cached_prompt_tokens_total - before.cached_prompt_tokens_total))
    assert computed_by_usage == computed_by_engine == length
    assert computed_by_engine / (4 * length) <= 0.3
    outputs = [tuple(ids(samples[i])) for i in range(4)]
    # Each sample is its own seed's: that seed alone reproduces it. Two samples may still agree by chance
    # (12 tokens at temperature 1 where the model is sure of them), so distinctness asks only that the
    # seeds made a difference at all. Each run again has a salt of its own, so it computes the prompt cold as
    # the first did (the server reuses cached cells to the token, whose last row computed alone may sample
    # otherwise: docs/engines.md, prefix_cache_exact).
    for index, output in enumerate(outputs):
        alone = by_sample(stub.GenerateStream(sampled(prompt, 1, seed=1000 + index, cache_salt=secrets.token_hex(4)),
                                              timeout=120))
        assert tuple(ids(alone[0])) == output, f"seed {1000 + index} alone gave another sample"
    assert len(set(outputs)) > 1, "four seeds gave one sample"
    again = by_sample(stub.GenerateStream(sampled(prompt, 4, seed=1000, cache_salt=secrets.token_hex(4)), timeout=120))
    assert [tuple(ids(again[i])) for i in range(4)] == outputs


def test_without_a_seed_each_sample_draws_its_own(stub):
    samples = by_sample(stub.GenerateStream(sampled(prompt_of(10), 3, seed=None), timeout=120))
    seeds = {samples[i][-1].finish.seed for i in range(3)}
    assert len(seeds) == 3


def test_unary_returns_every_sample(stub):
    request = pb.GenerateRequest.FromString(sampled(prompt_of(10), 3, max_new_tokens=6).SerializeToString())
    response = stub.Generate(request, timeout=120)
    assert [s.index for s in response.samples] == [0, 1, 2]
    assert response.text == response.samples[0].text and response.finish == response.samples[0].finish
    assert all(s.generated_tokens == 6 == len(s.tokens) for s in response.samples)
    assert len({s.finish.seed for s in response.samples}) == 3
    single = stub.Generate(pb.GenerateRequest.FromString(sampled(prompt_of(5), 1).SerializeToString()), timeout=60)
    assert not single.samples


def test_cancelling_the_call_cancels_every_sample(stub):
    call = stub.GenerateStream(sampled(prompt_of(10), 4, max_new_tokens=400), timeout=120)
    seen = set()
    for message in call:
        seen.add(message.index)
        if len(seen) == 4:
            break
    call.cancel()
    wait_for(lambda: stub.GetServerStatus(pb.GetServerStatusRequest()).running_sequences == 0,
             what="every sample freed")


def test_hostile_sample_counts(stub):
    for n in (17, 2**32 - 1):
        error = rpc_error(lambda n=n: list(stub.GenerateStream(sampled("Hi", n), timeout=30)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in bad_request_fields(error)
        assert len(error.details()) < 512
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.limits.max_samples == 16 and "n" in info.request_features
    # n = 0 means one.
    samples = by_sample(stub.GenerateStream(sampled("Hi", 0, max_new_tokens=2), timeout=30))
    assert list(samples) == [0]


@pytest.fixture(scope="module")
def small(tmp_path_factory, model_path):
    server = start_server(tmp_path_factory.mktemp("samples"), "--max-batch-size", "2", "--max-queued-requests", "1",
                          "--context-length", "512")
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
    assert stop_server(server) == 0, server.log()


def test_admission_counts_every_sample(small):
    """Capacity 3 (2 in the batch, 1 queued): 4 samples never fit, 3 do, and 2 samples queue behind a batch."""
    error = rpc_error(lambda: list(small.GenerateStream(sampled("Hi", 4), timeout=30)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(error) == "CALLER_OVER_LIMIT"
    samples = by_sample(small.GenerateStream(sampled(prompt_of(5), 3, max_new_tokens=4), timeout=60))
    assert sorted(samples) == [0, 1, 2]  # the third sample found the batch full and queued
    assert all(samples[i][-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS for i in range(3))


def test_the_python_client_streams_samples_and_tokenizes_with_offsets(server):
    import tokenspout

    with tokenspout.Client(server.address) as client:
        stream = client.stream(prompt_of(5), n=3, seed=11, temperature=1.0, max_new_tokens=5)
        chunks = list(stream)
        from tokenspout.streams import generation
        result = generation(chunks)
        assert {chunk.index for chunk in chunks} == {0, 1, 2}
        assert stream.finish is not None and stream.finish.seed == 11
        unary = client.generate(prompt_token_ids=client.tokenize("Hello there").token_ids, n=2, seed=3,
                                temperature=1.0, max_new_tokens=4, truncate_input_tokens=1)
        assert [s.index for s in unary.samples] == [0, 1] and unary.truncated_input_tokens == 1
        assert [s.finish.seed for s in unary.samples] == [3, 4]
        assert len(result.samples) == 3 and result.text == result.samples[0].text
        tokens = client.tokenize(texts=["héllo", "🙂"], return_offsets=True, add_special_tokens=False)
        assert [r.offsets.byte_ends[-1] for r in tokens.results] == [6, 4]
        info = client.model_info()
        assert "n" in info.request_features and info.limits.max_samples == 16


def _core_samples(model, core, request_id: str, seeds: tuple[int, ...], **fields):
    import dataclasses

    from backend.events import TokenEvent
    from backend.types import GenerationRequest, SamplingParams, StopParams
    from tests.backend.llamacpp.test_prefix_cache import check_cells
    from tests.harness.core_driver import Recorder

    request = GenerationRequest(request_id, tuple(model.tokenize("Once upon a time, in a quiet village,")),
                                SamplingParams(temperature=1.0, seed=seeds[0]), StopParams(max_new_tokens=10, ignore_eos=True),
                                sample_seeds=seeds, **fields)
    rec = Recorder(core)
    core.add(request, rec)
    for _ in range(500):
        if not core.has_work():
            break
        core.step()
        check_cells(core)  # every sample's slot holds exactly the cells the core believes
    by_index: dict[int, list[int]] = {}
    for _, event in rec.events:
        assert isinstance(event, TokenEvent), event
        by_index.setdefault(event.index, []).extend(t.token_id for t in event.tokens)
    finishes = {event.index: event.finish for _, event in rec.events if event.finish is not None}
    return dataclasses.replace(request), by_index, finishes


def test_in_the_core_samples_fork_from_the_first_ones_cells(model):
    """Driven step by step: the samples' cells are copies of the first one's prompt cells, one prompt's rows
    computed, each sample its own seed; cancelling the request ends every sample."""
    from backend.common.stats import CancelOrder
    from tests.harness.core_driver import make_core

    core = make_core(model, context_length=256, max_batch_size=4, batch_tokens=64)
    try:
        _, outputs, finishes = _core_samples(model, core, "r", (5, 6, 7, 8))
        assert sorted(outputs) == [0, 1, 2, 3] and all(len(tokens) == 10 for tokens in outputs.values())
        assert [finishes[i].seed for i in range(4)] == [5, 6, 7, 8]
        stats = core.core.stats
        assert stats.prompt_tokens_total - stats.cached_prompt_tokens_total == finishes[0].usage.prompt_tokens
        assert len({tuple(t) for t in outputs.values()}) == 4
        # Cancelling by the request's id ends every sample, waiting ones included.
        from backend.types import GenerationRequest, SamplingParams, StopParams
        from tests.harness.core_driver import Recorder

        rec = Recorder(core)
        core.add(GenerationRequest("c", tuple(model.tokenize("Hello")), SamplingParams(temperature=1.0),
                                   StopParams(max_new_tokens=100), sample_seeds=(1, 2, 3)), rec)
        core.step()
        core.cancel(CancelOrder("c", 0.0, core.steps))
        ended = {event.index for _, event in rec.events if event.finish is not None}
        assert ended == {0, 1, 2} and not core.has_work()
    finally:
        core.close()
