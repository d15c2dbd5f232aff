"""End to end: a real server on a loopback port, the real embedded model (the request id and health
checks, which are the service's alone, on the fake engine)."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.helpers import greedy, stream, text_of, token_ids_of
from tests.harness.servers import SERVER_CONTEXT_LENGTH
from tokenspout.v1 import generation_pb2 as pb

FINISH = pb.FinishReason
PROMPT = "The three primary colours are"


def test_tokens_arrive_incrementally(stub):
    call = stub.GenerateStream(greedy(PROMPT, max_new_tokens=32, ignore_eos=True), timeout=60)
    first = next(call)
    # The first message comes while most tokens are still to come (a single one, unless the
    # server's loop lagged a step behind the engine).
    assert 1 <= first.generated_tokens < 8 and not first.HasField("finish")
    assert first.input_tokens > 0
    rest = list(call)
    assert len(rest) >= 1 and rest[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS
    assert all(m.input_tokens == 0 for m in rest)
    counts = [first.generated_tokens] + [m.generated_tokens for m in rest]
    assert counts == sorted(counts) and counts[-1] == 32
    timings = rest[-1].finish.timings
    assert 0 < timings.time_to_first_token_ms < timings.total_ms


def test_greedy_output_is_deterministic(stub):
    a = stream(stub, greedy(PROMPT, max_new_tokens=40))
    b = stream(stub, greedy(PROMPT, max_new_tokens=40))
    assert token_ids_of(a) == token_ids_of(b) and text_of(a) == text_of(b)
    assert a[-1].finish.seed == 0


def sampled(seed: int | None) -> pb.GenerateStreamRequest:
    request = pb.GenerateStreamRequest(
        prompt="Once upon a time",
        sampling=pb.SamplingParams(temperature=1.0, top_p=0.95),
        stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True),
    )
    if seed is not None:
        request.sampling.seed = seed
    return request


def test_a_seed_reproduces_a_sampled_output(stub):
    first = stream(stub, sampled(1234))
    again = stream(stub, sampled(1234))
    other = stream(stub, sampled(99))
    assert text_of(first) == text_of(again)
    assert text_of(first) != text_of(other)
    assert first[-1].finish.seed == 1234


def test_the_seed_actually_used_is_reported_and_replays(stub):
    unseeded = stream(stub, sampled(None))
    seed = unseeded[-1].finish.seed
    assert text_of(stream(stub, sampled(seed))) == text_of(unseeded)
    assert stream(stub, sampled(None))[-1].finish.seed != seed, "each unseeded request draws its own seed"


def test_max_new_tokens(stub):
    messages = stream(stub, greedy(PROMPT, max_new_tokens=7, ignore_eos=True))
    finish = messages[-1].finish
    assert finish.reason == FINISH.FINISH_REASON_MAX_TOKENS
    assert messages[-1].generated_tokens == 7 == finish.usage.completion_tokens
    assert len(token_ids_of(messages)) == 7


def test_stop_sequence_ends_the_stream_and_never_leaks(stub):
    free = text_of(stream(stub, greedy(PROMPT, max_new_tokens=40, ignore_eos=True)))
    # A stop string from the middle of the free-running output, spanning token boundaries.
    stop = free[len(free) // 2 : len(free) // 2 + 6]
    assert len(stop.strip()) >= 3, free
    messages = stream(stub, greedy(PROMPT, max_new_tokens=40, ignore_eos=True, stop_sequences=[stop]))
    text = text_of(messages)
    assert text == free[: free.index(stop)]
    assert all(stop not in m.text for m in messages)
    assert messages[-1].finish.reason == FINISH.FINISH_REASON_STOP_SEQUENCE
    assert messages[-1].finish.stop_sequence == stop

    included = stream(
        stub, greedy(PROMPT, max_new_tokens=40, ignore_eos=True, stop_sequences=[stop], include_stop_sequence=True)
    )
    assert text_of(included) == free[: free.index(stop) + len(stop)]


def test_stop_token_id(stub):
    free = stream(stub, greedy(PROMPT, max_new_tokens=20, ignore_eos=True))
    ids = token_ids_of(free)
    stop_id = ids[5]
    first = ids.index(stop_id)
    messages = stream(stub, greedy(PROMPT, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]))
    finish = messages[-1].finish
    assert finish.reason == FINISH.FINISH_REASON_STOP_TOKEN and finish.stop_token_id == stop_id
    assert token_ids_of(messages) == ids[: first + 1]
    assert finish.usage.completion_tokens == first + 1


def chat(content: str, max_new_tokens: int = 64, **stopping) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=content)]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping),
        output=pb.OutputOptions(return_token_ids=True),
    )


def test_chat_ends_on_the_models_end_of_turn_token(stub, channel):
    messages = stream(stub, chat("Say hello.", max_new_tokens=200))
    finish = messages[-1].finish
    assert finish.reason == FINISH.FINISH_REASON_EOS_TOKEN
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert token_ids_of(messages)[-1] in info.special_tokens.eos_token_ids
    assert "<|im_end|>" not in text_of(messages) and text_of(messages).strip()


def test_min_new_tokens_and_ignore_eos_suppress_end_of_generation(stub):
    short = stream(stub, chat("Say hello.", max_new_tokens=200))
    n = short[-1].generated_tokens
    longer = stream(stub, chat("Say hello.", max_new_tokens=200, min_new_tokens=n + 5))
    assert longer[-1].generated_tokens >= n + 5
    ignored = stream(stub, chat("Say hello.", max_new_tokens=n + 10, ignore_eos=True))
    assert ignored[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS


def test_multibyte_text_streams_without_replacement_characters(stub):
    for prompt in ["中文：我喜欢吃", "Emoji party: 🎉🎉🎉 🙂🙂"]:
        messages = stream(stub, greedy(prompt, max_new_tokens=24, ignore_eos=True))
        tokens = [t for m in messages for t in m.tokens]
        # The test only means something if some code points were split across tokens.
        assert any(not t.text and t.bytes for t in tokens), prompt
        text = text_of(messages)
        assert "\ufffd" not in text and any(ord(c) > 0x2000 for c in text)
        assert text == b"".join(t.bytes for t in tokens).decode("utf-8", "ignore")


def test_streamed_deltas_equal_the_unary_result(stub):
    request = greedy(PROMPT, max_new_tokens=30)
    unary = stub.Generate(pb.GenerateRequest.FromString(request.SerializeToString()), timeout=60)
    messages = stream(stub, request)
    assert unary.text == text_of(messages)
    assert [t.id for t in unary.tokens] == token_ids_of(messages)
    assert unary.finish.reason == messages[-1].finish.reason
    assert unary.input_tokens == messages[0].input_tokens


def test_logprobs_and_top_alternatives(stub):
    request = greedy(PROMPT, max_new_tokens=8)
    request.output.return_logprobs = True
    request.output.top_logprobs = 3
    tokens = [t for m in stream(stub, request) for t in m.tokens]
    assert len(tokens) == 8
    for token in tokens:
        assert token.HasField("logprob") and token.logprob <= 0
        tops = [top.logprob for top in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.top_logprobs[0].id == token.id  # greedy takes the most likely token


def test_time_limit_ends_the_stream_normally(stub):
    request = greedy(PROMPT, max_new_tokens=SERVER_CONTEXT_LENGTH - 16, ignore_eos=True, time_limit_ms=300)
    messages = stream(stub, request)
    assert messages[-1].finish.reason == FINISH.FINISH_REASON_TIME_LIMIT
    assert 0 < messages[-1].generated_tokens < SERVER_CONTEXT_LENGTH - 16


def test_context_limit(stub):
    prompt = " ".join(["word"] * (SERVER_CONTEXT_LENGTH - 20))
    n_prompt = stub.Tokenize(pb.TokenizeRequest(text=prompt)).count
    assert n_prompt < SERVER_CONTEXT_LENGTH
    messages = stream(stub, greedy(prompt, max_new_tokens=200, ignore_eos=True))
    finish = messages[-1].finish
    assert finish.reason == FINISH.FINISH_REASON_CONTEXT_LIMIT
    assert finish.usage.prompt_tokens + finish.usage.completion_tokens == SERVER_CONTEXT_LENGTH


PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Paris is the capital of",
    "Water boils at",
    "The largest planet in the solar system is",
    "Once upon a time, a dragon",
    "import numpy as np\n",
    "My favourite fruit is",
]


def test_eight_concurrent_streams_match_their_solo_runs(stub):
    solo = {p: token_ids_of(stream(stub, greedy(p, max_new_tokens=24, ignore_eos=True))) for p in PROMPTS}
    steps_before = stub.GetServerStatus(pb.GetServerStatusRequest()).engine_steps
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = dict(
            zip(PROMPTS, pool.map(lambda p: stream(stub, greedy(p, max_new_tokens=24, ignore_eos=True)), PROMPTS))
        )
    # They ran together: run one after another, they would have taken 8 x 24 steps.
    assert stub.GetServerStatus(pb.GetServerStatusRequest()).engine_steps - steps_before < 96
    for prompt, messages in results.items():
        assert all(m.request_id == messages[0].request_id for m in messages)
        ids = token_ids_of(messages)
        assert len(ids) == 24
        # Each prompt is computed in groups of its own (backend.llamacpp.layout) and each sequence
        # has its own cache, so what else runs changes no number: greedy output is the same.
        assert ids == solo[prompt], prompt


def test_request_id_is_echoed(fake_stub):
    request = greedy(PROMPT, max_new_tokens=3)
    request.request_id = "my-request-42"
    assert {m.request_id for m in stream(fake_stub, request)} == {"my-request-42"}


def test_a_cancelled_stream_leaves_the_server_serving(stub):
    call = stub.GenerateStream(greedy(PROMPT, max_new_tokens=500, ignore_eos=True), timeout=60)
    next(call)
    call.cancel()
    assert stream(stub, greedy(PROMPT, max_new_tokens=4))[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS


def test_tokenize_matches_generation_input(stub):
    response = stub.Tokenize(pb.TokenizeRequest(text="héllo 🙂"))
    assert response.count == len(response.token_ids) == len(response.pieces)
    assert b"".join(response.pieces).decode() == "héllo 🙂"
    messages = stream(stub, greedy("héllo 🙂", max_new_tokens=1))
    assert messages[0].input_tokens == response.count
    chat_tokens = stub.Tokenize(pb.TokenizeRequest(chat=chat("Say hello.").chat))
    assert stream(stub, chat("Say hello.", max_new_tokens=1))[0].input_tokens == chat_tokens.count


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == "SmolLM2-135M-Instruct-Q4_1" and info.engine == "llama.cpp"
    assert info.context_length == SERVER_CONTEXT_LENGTH and info.vocab_size == 49152
    assert info.has_chat_template and len(info.special_tokens.eos_token_ids) >= 1
    assert info.quantization == "Q4_1"
    assert {"temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "logit_bias"} <= set(info.samplers)
    assert info.limits.max_batch_size == 8
    # Cached cells are reused to the token, answers' too, as llama-server reuses them (prefix_cache_exact is off).
    assert info.prefix_reuse == pb.PREFIX_REUSE_AS_CACHED and info.reuses_decoded_cells
    assert stub.GetServerStatus(pb.GetServerStatusRequest()).prefix_reuse == pb.PREFIX_REUSE_AS_CACHED
    assert json_format.MessageToDict(info)  # serializes for grpcurl users


@pytest.mark.parametrize(
    "description, expected",
    [("llama 135M Q4_1", "Q4_1"), ("llama 8B Q4_K - Medium", "Q4_K - Medium"),
     ("qwen2 7B (guessed) IQ2_XXS - 2.0625 bpw", "IQ2_XXS - 2.0625 bpw")],
)
def test_the_gguf_type_is_read_whole_from_llama_cpps_description(description, expected):
    from backend.llamacpp.model import gguf_type

    assert gguf_type(description) == expected


def test_logit_bias_bans_and_forces_tokens(stub):
    free = token_ids_of(stream(stub, greedy(PROMPT, max_new_tokens=4)))
    request = greedy(PROMPT, max_new_tokens=4)
    request.sampling.logit_bias[free[0]] = -100.0
    assert token_ids_of(stream(stub, request))[0] != free[0]
    forced = greedy(PROMPT, max_new_tokens=3, ignore_eos=True)
    forced.sampling.logit_bias[1000] = 100.0
    assert token_ids_of(stream(stub, forced)) == [1000, 1000, 1000]


def test_health_reports_serving(fake_channel):
    health = health_pb2_grpc.HealthStub(fake_channel)
    for service in ("", "tokenspout.v1.GenerationService"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    try:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        raise AssertionError("unknown service must be NOT_FOUND")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND
