"""Prompt logprobs on the real model: every prompt token's logprob given the ones before it.

They must equal what the one-by-one computation gives (each prefix alone, its next
token forced with a logit bias, which llama.cpp's logprobs come before) within 1e-3,
and a prompt the prefix cache holds is computed again for them (cached_tokens 0).
"""

from __future__ import annotations

import grpc

from tests.harness.helpers import bad_request_fields, rpc_error
from tokenspout.v1 import generation_pb2 as pb

PROMPT = "The capital of France is Paris. The capital of Italy is Rome, and"


def request_of(ids: list[int], **output) -> pb.GenerateStreamRequest:
    request = pb.GenerateStreamRequest(
        sampling=pb.SamplingParams(temperature=0.0), stopping=pb.StoppingCriteria(max_new_tokens=1),
        output=pb.OutputOptions(**output),
    )
    request.prompt_token_ids.ids.extend(ids)
    return request


def test_prompt_logprobs_equal_the_one_by_one_computation(stub):
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=30).token_ids)
    first = list(stub.GenerateStream(request_of(ids, prompt_logprobs=True, prompt_top_logprobs=3), timeout=60))
    scored = first[0].prompt_tokens
    assert [t.id for t in scored] == ids and not any(m.prompt_tokens for m in first[1:])
    assert not scored[0].HasField("logprob")
    for token in scored[1:]:
        assert len(token.top_logprobs) == 3 and token.logprob <= token.top_logprobs[0].logprob + 1e-6
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    assert first[-1].finish.usage.cached_tokens == 0
    for j in range(1, len(ids)):
        alone = request_of(ids[:j], return_logprobs=True)
        alone.sampling.logit_bias[ids[j]] = 100.0
        token = list(stub.GenerateStream(alone, timeout=60))[-1].tokens[0]
        assert token.id == ids[j]
        assert abs(token.logprob - scored[j].logprob) <= 1e-3, (j, token.logprob, scored[j].logprob)
    # Asked again, the prompt is in the prefix cache: it is computed again, with the same result.
    again = list(stub.GenerateStream(request_of(ids, prompt_logprobs=True), timeout=60))
    assert again[-1].finish.usage.cached_tokens == 0
    assert [round(t.logprob, 4) for t in again[0].prompt_tokens[1:]] == [round(t.logprob, 4) for t in scored[1:]]
    assert not again[0].prompt_tokens[1].top_logprobs


def test_prompt_logprobs_in_unary_and_with_samples(stub):
    ids = list(stub.Tokenize(pb.TokenizeRequest(text="One, two, three,"), timeout=30).token_ids)
    unary = stub.Generate(pb.GenerateRequest.FromString(request_of(ids, prompt_logprobs=True).SerializeToString()),
                          timeout=60)
    assert [t.id for t in unary.prompt_tokens] == ids
    sampled = request_of(ids, prompt_logprobs=True)
    sampled.n = 3
    messages = list(stub.GenerateStream(sampled, timeout=60))
    with_scores = [m for m in messages if m.prompt_tokens]
    assert len(with_scores) == 1 and with_scores[0].index == 0
    assert [round(t.logprob, 4) for t in with_scores[0].prompt_tokens[1:]] == \
        [round(t.logprob, 4) for t in unary.prompt_tokens[1:]]


def test_hostile_prompt_logprob_requests(stub):
    error = rpc_error(lambda: list(stub.GenerateStream(request_of([1, 2], prompt_top_logprobs=21), timeout=30)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "output.prompt_top_logprobs" in bad_request_fields(error)
    huge = rpc_error(lambda: list(stub.GenerateStream(request_of([1, 2], prompt_top_logprobs=2**32 - 1), timeout=30)))
    assert huge.code() == grpc.StatusCode.INVALID_ARGUMENT and len(huge.details()) < 512
    one = list(stub.GenerateStream(request_of([ids_first := 504], prompt_logprobs=True), timeout=30))
    assert [t.id for t in one[0].prompt_tokens] == [ids_first] and not one[0].prompt_tokens[0].HasField("logprob")
