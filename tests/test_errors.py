"""Bad input gets a clear gRPC status with google.rpc details, and never harms the server."""

from __future__ import annotations

import grpc
import pytest

from conftest import SERVER_CONTEXT_LENGTH
from helpers import bad_request_fields, greedy, rpc_error, stream
from tokenspout.v1 import generation_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def generate_error(stub, request: pb.GenerateStreamRequest) -> grpc.RpcError:
    return rpc_error(lambda: stub.GenerateStream(request, timeout=30))


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("typical_p", 0.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("top_k", 10**6),
        ("seed", 2**32 - 1),
    ],
)
def test_out_of_range_sampling_values(stub, field, value):
    request = greedy("hi")
    request.sampling.ClearField("temperature")
    setattr(request.sampling, field, value)
    error = generate_error(stub, request)
    assert error.code() == INVALID
    assert f"sampling.{field}" in bad_request_fields(error)


def test_every_violation_is_reported_at_once(stub):
    request = pb.GenerateStreamRequest(
        prompt="",
        sampling=pb.SamplingParams(temperature=-1),
        stopping=pb.StoppingCriteria(max_new_tokens=0, stop_sequences=[""], stop_token_ids=[10**7]),
        output=pb.OutputOptions(top_logprobs=1000),
    )
    request.sampling.logit_bias[-3] = 1.0
    error = generate_error(stub, request)
    assert error.code() == INVALID
    assert set(bad_request_fields(error)) == {
        "prompt",
        "sampling.temperature",
        "sampling.logit_bias[-3]",
        "stopping.max_new_tokens",
        "stopping.stop_sequences[0]",
        "stopping.stop_token_ids[0]",
        "output.top_logprobs",
    }


@pytest.mark.parametrize(
    "request_",
    [
        pb.GenerateStreamRequest(),
        pb.GenerateStreamRequest(chat=pb.Chat()),
        pb.GenerateStreamRequest(chat=pb.Chat(messages=[pb.ChatMessage(content="no role")])),
        pb.GenerateStreamRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=5)),
        pb.GenerateStreamRequest(prompt="x", stopping=pb.StoppingCriteria(stop_sequences=["s"] * 17)),
        pb.GenerateStreamRequest(prompt="x", request_id="r" * 200),
    ],
    ids=["no-input", "empty-chat", "no-role", "min-over-max", "too-many-stops", "long-request-id"],
)
def test_malformed_requests(stub, request_):
    error = generate_error(stub, request_)
    assert error.code() == INVALID and bad_request_fields(error)


def test_a_prompt_longer_than_the_context_is_out_of_range(stub):
    error = generate_error(stub, greedy("word " * SERVER_CONTEXT_LENGTH))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "prompt" in bad_request_fields(error)
    assert "context" in error.details()


def test_max_new_tokens_beyond_the_context_is_invalid(stub):
    error = generate_error(stub, greedy("hi", max_new_tokens=SERVER_CONTEXT_LENGTH + 1))
    assert error.code() == INVALID and "stopping.max_new_tokens" in bad_request_fields(error)


def test_unknown_model_is_not_found_on_every_rpc(stub):
    request = greedy("hi")
    request.model = "gpt-unknown"
    calls = [
        lambda: stub.GenerateStream(request, timeout=10),
        lambda: stub.Generate(pb.GenerateRequest.FromString(request.SerializeToString()), timeout=10),
        lambda: stub.Tokenize(pb.TokenizeRequest(model="gpt-unknown", text="x"), timeout=10),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(model="gpt-unknown"), timeout=10),
    ]
    for call in calls:
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "model" in bad_request_fields(error)


def test_the_served_model_can_be_named(stub):
    request = greedy("hi", max_new_tokens=2)
    request.model = stub.GetModelInfo(pb.GetModelInfoRequest()).model_id
    assert stream(stub, request)[-1].HasField("finish")


def test_bad_requests_do_not_disturb_a_running_stream(stub):
    call = stub.GenerateStream(greedy("The sky is", max_new_tokens=48, ignore_eos=True), timeout=60)
    first = next(call)
    for _ in range(5):
        assert generate_error(stub, greedy("")).code() == INVALID
    rest = list(call)
    assert rest[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
    assert first.generated_tokens + sum(len(m.tokens) for m in rest) == 48
