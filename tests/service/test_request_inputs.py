"""Token ids as input, and truncate_input_tokens, on the real model.

Token input must give exactly the output of the same text; truncation keeps
exactly the last N tokens of a prompt, and a chat loses whole messages, oldest
first, never its system message nor its last one.
"""

from __future__ import annotations

import grpc

from tests.harness.helpers import bad_request_fields, greedy, rpc_error, stream, text_of, token_ids_of
from tokenspout.v1 import generation_pb2 as pb

PROMPT = "The three primary colours are red, yellow and"


def ids_of(stub, text: str, add_special: bool = True) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special), timeout=30).token_ids)


def by_ids(ids: list[int], max_new_tokens: int = 16, **fields) -> pb.GenerateStreamRequest:
    request = greedy("", max_new_tokens=max_new_tokens)
    request.ClearField("prompt")
    request.prompt_token_ids.ids.extend(ids)
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def test_token_input_gives_the_output_of_the_same_text(stub):
    from_text = stream(stub, greedy(PROMPT, max_new_tokens=16))
    from_ids = stream(stub, by_ids(ids_of(stub, PROMPT)))
    assert token_ids_of(from_ids) == token_ids_of(from_text) and text_of(from_ids) == text_of(from_text)
    assert from_ids[0].input_tokens == from_text[0].input_tokens
    unary = stub.Generate(pb.GenerateRequest.FromString(by_ids(ids_of(stub, PROMPT)).SerializeToString()), timeout=60)
    assert unary.text == text_of(from_text)


def test_token_ids_outside_the_vocabulary_are_named_and_bounded(stub):
    vocab = stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
    error = rpc_error(lambda: stream(stub, by_ids([1, vocab, -1, 5])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = bad_request_fields(error)
    assert set(fields) == {"prompt_token_ids.ids[1]", "prompt_token_ids.ids[2]"}
    assert str(vocab) in fields["prompt_token_ids.ids[1]"]
    flood = rpc_error(lambda: stream(stub, by_ids([vocab + 7] * 200_000)))
    assert flood.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(bad_request_fields(flood)) <= 10 and len(flood.details()) < 1024
    empty = rpc_error(lambda: stream(stub, by_ids([])))
    assert "prompt_token_ids.ids" in bad_request_fields(empty)
    too_long = rpc_error(lambda: stream(stub, by_ids([ids_of(stub, "a", False)[0]] * 5000)))
    assert too_long.code() == grpc.StatusCode.OUT_OF_RANGE
    assert stream(stub, greedy(PROMPT, max_new_tokens=2))[-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS


def test_truncation_keeps_exactly_the_last_n_tokens(stub):
    long_prompt = " ".join(f"item {i}," for i in range(120)) + " and the last item is"
    ids = ids_of(stub, long_prompt)
    assert 400 < len(ids) < 1000
    kept = stream(stub, greedy(long_prompt, max_new_tokens=8))
    truncated = stream(stub, pb.GenerateStreamRequest.FromString(greedy(long_prompt, max_new_tokens=8).SerializeToString()
                                                                 + pb.GenerateStreamRequest(truncate_input_tokens=100)
                                                                 .SerializeToString()))
    assert truncated[0].input_tokens == 100 and truncated[0].truncated_input_tokens == len(ids) - 100
    assert kept[0].truncated_input_tokens == 0
    same = stream(stub, by_ids(ids[-100:], max_new_tokens=8))
    assert token_ids_of(truncated) == token_ids_of(same)  # exactly the last 100 tokens were the prompt
    by_id_truncation = stream(stub, by_ids(ids, max_new_tokens=8, truncate_input_tokens=100))
    assert token_ids_of(by_id_truncation) == token_ids_of(same)
    # Beyond the prompt's length: nothing dropped.
    beyond = stream(stub, by_ids(ids[:50], max_new_tokens=2, truncate_input_tokens=2**32 - 1))
    assert beyond[0].input_tokens == 50 and beyond[0].truncated_input_tokens == 0
    # A prompt longer than the context fits once truncated.
    huge = " ".join(f"word{i}" for i in range(3000))
    assert rpc_error(lambda: stream(stub, greedy(huge, max_new_tokens=2))).code() == grpc.StatusCode.OUT_OF_RANGE
    fits = stream(stub, by_ids(ids_of(stub, huge), max_new_tokens=2, truncate_input_tokens=200))
    assert fits[0].input_tokens == 200


def chat_request(messages: list[tuple[str, str]], keep: int) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=pb.SamplingParams(temperature=0.0), stopping=pb.StoppingCriteria(max_new_tokens=4),
        truncate_input_tokens=keep, output=pb.OutputOptions(return_token_ids=True),
    )


def chat_tokens(stub, messages: list[tuple[str, str]]) -> int:
    chat = pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
    return stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30).count


def test_a_truncated_chat_drops_whole_messages_oldest_first_but_never_its_system_or_last(stub):
    system = ("system", "You are a terse assistant.")
    turns = []
    for i in range(12):
        turns += [("user", f"Question {i}: " + "tell me more " * 10), ("assistant", f"Answer {i}: " + "sure " * 10)]
    last = ("user", "What is two plus two?")
    messages = [system, *turns, last]
    full = chat_tokens(stub, messages)
    keep = full // 3
    response = stream(stub, chat_request(messages, keep))
    dropped = response[0].truncated_input_tokens
    assert dropped > 0 and response[0].input_tokens == full - dropped <= keep
    # The fewest oldest messages went: the same chat without them is exactly what was computed ...
    fewest = next(k for k in range(len(turns)) if chat_tokens(stub, [system, *turns[k:], last]) <= keep)
    assert chat_tokens(stub, [system, *turns[fewest:], last]) == response[0].input_tokens
    same = stream(stub, chat_request([system, *turns[fewest:], last], 0))
    assert token_ids_of(same) == token_ids_of(response)
    # ... and when even the system message and the last one are over the limit, those two stay.
    tiny = stream(stub, chat_request(messages, 5))
    assert tiny[0].input_tokens == chat_tokens(stub, [system, last])
    assert tiny[0].truncated_input_tokens == full - tiny[0].input_tokens
    without_system = stream(stub, chat_request([*turns, last], 5))
    assert without_system[0].input_tokens == chat_tokens(stub, [last])


def test_chat_truncation_finds_the_fewest_messages_to_drop_by_bisection():
    from backend.types import ChatMessage
    from service.chat.render import truncated_chat

    renders = []

    def render(messages):  # ten tokens a message
        renders.append(len(messages))
        return [0] * (10 * len(messages))

    messages = [ChatMessage("system", "s"), *(ChatMessage("user", str(i)) for i in range(99)), ChatMessage("user", "last")]
    kept, tokens = truncated_chat(messages, render(messages), 255, render)
    assert kept[0].role == "system" and kept[-1].content == "last" and len(tokens) == 250
    assert [m.content for m in kept[1:-1]] == [str(i) for i in range(76, 99)]
    assert len(renders) <= 10
    assert truncated_chat(messages, [0] * 1010, 1, render)[0] == [messages[0], messages[-1]]


def test_an_engine_without_samples_or_prompt_logprobs_names_the_field(fake_stub):
    """The fake engine serves token input and truncation but not n or prompt logprobs (exllamav2 lacks the latter)."""
    from backend.exllama.engine import EXLLAMA_REQUEST_FEATURES
    from tests.harness.helpers import error_reason

    info = fake_stub.GetModelInfo(pb.GetModelInfoRequest())
    assert tuple(info.request_features) == ("prompt_token_ids", "truncate_input_tokens")
    assert "output.prompt_logprobs" not in EXLLAMA_REQUEST_FEATURES
    for field, request in (
        ("n", pb.GenerateStreamRequest(prompt="Hi", n=2)),
        ("output.prompt_logprobs", pb.GenerateStreamRequest(prompt="Hi", output=pb.OutputOptions(prompt_logprobs=True))),
        ("output.prompt_logprobs", pb.GenerateStreamRequest(prompt="Hi", output=pb.OutputOptions(prompt_top_logprobs=2))),
    ):
        error = rpc_error(lambda request=request: list(fake_stub.GenerateStream(request, timeout=10)))
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED and set(bad_request_fields(error)) == {field}, error_reason(error)
    by_ids = pb.GenerateStreamRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), truncate_input_tokens=2,
                                      stopping=pb.StoppingCriteria(max_new_tokens=2))
    messages = list(fake_stub.GenerateStream(by_ids, timeout=10))
    assert messages[0].input_tokens == 2 and messages[0].truncated_input_tokens == 1
