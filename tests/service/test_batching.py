"""How tokens are grouped into messages (OutputOptions), on the fake engine in process: a script decides
when tokens exist, so what each message holds follows from the options alone."""

from __future__ import annotations

from tests.harness.helpers import greedy, stream
from tokenspout.v1 import generation_pb2 as pb


def request(request_id: str, max_new_tokens: int, **output) -> pb.GenerateStreamRequest:
    message = greedy("Count the tokens", max_new_tokens=max_new_tokens, ignore_eos=True)
    message.request_id = request_id
    for name, value in output.items():
        setattr(message.output, name, value)
    return message


def sizes(messages: list[pb.GenerateStreamResponse]) -> list[int]:
    return [len(m.tokens) for m in messages]


def test_each_message_holds_between_the_minimum_and_the_cap(fake_stub):
    messages = stream(fake_stub, request("", 23, min_tokens_per_message=5, max_tokens_per_message=5), timeout=30)
    assert sizes(messages) == [5, 5, 5, 5, 3]
    assert [m.generated_tokens for m in messages] == [5, 10, 15, 20, 23]
    assert messages[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS


def test_min_tokens_per_message_waits_for_tokens_until_the_flush_interval(fake_server, fake_stub):
    held = fake_server.engine.plan("gathered-", hold_after=2)
    call = fake_stub.GenerateStream(
        request("gathered-1", 12, min_tokens_per_message=4, flush_interval_ms=200), timeout=30
    )
    first = next(call)  # only two tokens exist: the interval sends them short of the minimum
    assert len(first.tokens) == 2 and not first.HasField("finish")
    fake_server.engine.let_go(held)
    rest = list(call)
    assert all(size >= 4 for size in sizes(rest[:-1])) and sum(sizes([first, *rest])) == 12
    assert rest[-1].finish.reason == pb.FinishReason.FINISH_REASON_MAX_TOKENS


def test_the_last_message_comes_at_once_whatever_the_minimum(fake_stub):
    messages = stream(fake_stub, request("", 10, min_tokens_per_message=64, flush_interval_ms=60_000), timeout=30)
    assert sizes(messages) == [10] and messages[-1].HasField("finish")
