"""Bad input gets a clear gRPC status with google.rpc details, and never harms the server (on the fake engine)."""

from __future__ import annotations

import grpc
import pytest
from grpc_status import rpc_status

from service.errors import MAX_STATUS_BYTES
from tests.harness.helpers import bad_request_fields, error_reason, greedy, rpc_error, stream
from tests.harness.inprocess_server import start_fake
from tests.harness.servers import SERVER_CONTEXT_LENGTH
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

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
def test_out_of_range_sampling_values(fake_stub, field, value):
    request = greedy("hi")
    request.sampling.ClearField("temperature")
    setattr(request.sampling, field, value)
    error = generate_error(fake_stub, request)
    assert error.code() == INVALID
    assert f"sampling.{field}" in bad_request_fields(error)


def test_every_violation_is_reported_at_once(fake_stub):
    request = pb.GenerateStreamRequest(
        prompt="",
        sampling=pb.SamplingParams(temperature=-1),
        stopping=pb.StoppingCriteria(max_new_tokens=0, stop_sequences=[""], stop_token_ids=[10**7]),
        output=pb.OutputOptions(top_logprobs=1000),
    )
    request.sampling.logit_bias[-3] = 1.0
    error = generate_error(fake_stub, request)
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
    "request_, expected",
    [
        (pb.GenerateStreamRequest(), "prompt"),
        (pb.GenerateStreamRequest(chat=pb.Chat()), "chat.messages"),
        (pb.GenerateStreamRequest(chat=pb.Chat(messages=[pb.ChatMessage(content="no role")])), "chat.messages[0].role"),
        (pb.GenerateStreamRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=5)),
         "stopping.min_new_tokens"),
        (pb.GenerateStreamRequest(prompt="x", stopping=pb.StoppingCriteria(stop_sequences=["s"] * 17)),
         "stopping.stop_sequences"),
        (pb.GenerateStreamRequest(prompt="x", request_id="r" * 200), "request_id"),
    ],
    ids=["no-input", "empty-chat", "no-role", "min-over-max", "too-many-stops", "long-request-id"],
)
def test_malformed_requests(fake_stub, request_, expected):
    error = generate_error(fake_stub, request_)
    assert error.code() == INVALID and set(bad_request_fields(error)) == {expected}


def test_a_prompt_longer_than_the_context_is_out_of_range(fake_stub):
    error = generate_error(fake_stub, greedy("word " * SERVER_CONTEXT_LENGTH))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "prompt" in bad_request_fields(error)
    assert "context" in error.details()


def test_max_new_tokens_beyond_the_context_is_invalid(fake_stub):
    error = generate_error(fake_stub, greedy("hi", max_new_tokens=SERVER_CONTEXT_LENGTH + 1))
    assert error.code() == INVALID and "stopping.max_new_tokens" in bad_request_fields(error)


def test_unknown_model_is_not_found_on_every_rpc(fake_stub):
    request = greedy("hi")
    request.model = "gpt-unknown"
    calls = [
        lambda: fake_stub.GenerateStream(request, timeout=10),
        lambda: fake_stub.Generate(pb.GenerateRequest.FromString(request.SerializeToString()), timeout=10),
        lambda: fake_stub.Tokenize(pb.TokenizeRequest(model="gpt-unknown", text="x"), timeout=10),
        lambda: fake_stub.GetModelInfo(pb.GetModelInfoRequest(model="gpt-unknown"), timeout=10),
    ]
    for call in calls:
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "model" in bad_request_fields(error)


def test_the_served_model_can_be_named(fake_stub):
    request = greedy("hi", max_new_tokens=2)
    request.model = fake_stub.GetModelInfo(pb.GetModelInfoRequest()).model_id
    assert stream(fake_stub, request)[-1].HasField("finish")


def test_bad_requests_do_not_disturb_a_running_stream(fake_server, fake_stub):
    running = fake_server.engine.plan("running-", hold_after=1)  # it runs until the bad requests are answered
    request = greedy("The sky is", max_new_tokens=48, ignore_eos=True)
    request.request_id = "running-1"
    call = fake_stub.GenerateStream(request, timeout=60)
    first = next(call)
    for _ in range(5):
        assert generate_error(fake_stub, greedy("")).code() == INVALID
    fake_server.engine.let_go(running)
    rest = list(call)
    assert rest[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS
    assert first.generated_tokens + sum(len(m.tokens) for m in rest) == 48


# -- the error boundary: malformed bytes, oversized errors, unexpected failures -------------------


def test_malformed_request_bytes_are_invalid_argument_without_a_traceback(fake_server, fake_channel):
    not_a_message = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length past the end of the data
    for method in ("Generate", "Tokenize", "CompileConstraint"):
        call = fake_channel.unary_unary(f"/tokenspout.v1.GenerationService/{method}")
        error = rpc_error(lambda call=call: call(not_a_message, timeout=10))
        assert error.code() == INVALID and error_reason(error) == "MALFORMED_REQUEST", error.details()
    stream = fake_channel.unary_stream("/tokenspout.v1.GenerationService/GenerateStream")
    error = rpc_error(lambda: stream(not_a_message, timeout=10))
    assert error.code() == INVALID and "GenerateStreamRequest" in error.details()
    assert "Traceback" not in fake_server.log()


def status_size(error: grpc.RpcError) -> int:
    status = rpc_status.from_call(error)
    assert status is not None
    return status.ByteSize()


def oversized_requests() -> dict[str, pb.GenerateStreamRequest]:
    bias = greedy("hi")
    for token in range(10**7, 10**7 + 100):
        bias.sampling.logit_bias[token] = 1.0
    stops = greedy("hi")
    stops.stopping.stop_token_ids.extend(range(-300, 0))
    model = greedy("hi")
    model.model = "m" * 16_384
    wide = greedy("hi")
    wide.stopping.stop_sequences.extend(["\U0001f642" * 5000] * 16)
    echoing = greedy("hi")  # llguidance quotes the whole 100 kB line in its error
    echoing.constraint.grammar = "start: " + "x" * 50_000 + " ("
    return {
        "logit-bias": bias, "stop-token-ids": stops, "model-name": model, "multibyte-stops": wide,
        "grammar-error": echoing,
    }


@pytest.mark.parametrize("name", ["logit-bias", "stop-token-ids", "model-name", "multibyte-stops", "grammar-error"])
def test_errors_stay_small_whatever_the_input(fake_stub, name):
    error = generate_error(fake_stub, oversized_requests()[name])
    assert error.code() in (INVALID, grpc.StatusCode.NOT_FOUND), error.details()
    assert status_size(error) <= MAX_STATUS_BYTES
    assert len(error.details().encode()) <= 1024


def test_a_long_violation_list_says_how_many_more(fake_stub):
    error = generate_error(fake_stub, oversized_requests()["logit-bias"])
    fields = bad_request_fields(error)
    assert fields["..."] == "and 92 more" and len(fields) == 9


def test_overload_advises_grpc_retry_pushback():
    server = start_fake("--max-batch-size", "1", "--max-queued-requests", "0", "--context-length", "256")
    server.engine.plan("", hold_after=1)  # the running stream stays running, as a long generation would
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            running = stub.GenerateStream(greedy("Count:", max_new_tokens=200, ignore_eos=True), timeout=60)
            next(running)
            error = generate_error(stub, greedy("hi"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(error.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
            running.cancel()
    finally:
        server.close()


async def test_an_unexpected_exception_is_internal_with_the_request_id_and_logged_once(caplog):
    """The boundary itself, on a real socket, around a handler with a bug."""
    from service.boundary import ErrorBoundary

    class Buggy(pb_grpc.GenerationServiceServicer):
        async def GetModelInfo(self, request, context):
            raise KeyError("a bug")

        async def GenerateStream(self, request, context):
            yield pb.GenerateStreamResponse(text="partial")
            raise ZeroDivisionError

    server = grpc.aio.server(interceptors=[ErrorBoundary()])
    pb_grpc.add_GenerationServiceServicer_to_server(Buggy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert raised.value.code() == grpc.StatusCode.INTERNAL
            call = stub.GenerateStream(pb.GenerateStreamRequest(request_id="req-7"), timeout=10)
            assert (await call.read()).text == "partial"
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call.read()
            assert raised.value.code() == grpc.StatusCode.INTERNAL and "req-7" in raised.value.details()
    finally:
        await server.stop(None)
    tracebacks = [r for r in caplog.records if r.name == "service.boundary" and r.exc_info]
    assert [type(r.exc_info[1]) for r in tracebacks] == [KeyError, ZeroDivisionError]
