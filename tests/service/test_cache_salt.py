"""Cache isolation and generated tokens kept, through real `tokenspout serve` processes on the real model:
cache_salt, the server's cache_scope with two API keys, a bad salt, and a chat whose next turn takes the
previous answer from the cache."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from service.cache_scope import CacheScope, cache_salt
from tests.harness.helpers import bad_request_fields, rpc_error
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SYSTEM = ("You are the assistant of a hardware shop. Answer in one short sentence, name the aisle where the item "
          "is found, and never invent prices. The shop sells tools, paint, garden supplies, timber, fixings, "
          "lighting and plumbing parts, and it opens at eight every morning.")
KEYS = {"alice": "alice-cache-key", "bob": "bob-cache-key"}
FLAGS = ("--max-batch-size", "2", "--prefix-cache-slots", "6", "--context-length", "1024", "--threads", "2")


def chat_request(*turns: str, salt: str = "", max_new_tokens: int = 12) -> pb.GenerateStreamRequest:
    roles = ["user", "assistant"] * len(turns)
    messages = [pb.ChatMessage(role="system", content=SYSTEM)]
    messages += [pb.ChatMessage(role=role, content=text) for role, text in zip(roles, turns)]
    return pb.GenerateStreamRequest(chat=pb.Chat(messages=messages), cache_salt=salt,
                                    sampling=pb.SamplingParams(temperature=0.0),
                                    stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))


def served(stub, request, key: str = "") -> tuple[str, pb.Usage]:
    metadata = (("authorization", f"Bearer {KEYS[key]}"),) if key else ()
    messages = list(stub.GenerateStream(request, timeout=120, metadata=metadata))
    return "".join(m.text for m in messages), messages[-1].finish.usage


@pytest.fixture(scope="module")
def shared(tmp_path_factory, model_path):
    server = start_server(tmp_path_factory.mktemp("shared"), *FLAGS)
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def per_caller(tmp_path_factory, model_path):
    keys = ",".join(f"{name}:{hashlib.sha256(key.encode()).hexdigest()}" for name, key in KEYS.items())
    server = start_server(tmp_path_factory.mktemp("caller"), *FLAGS, env={
        "TOKENSPOUT_API_KEYS": keys, "TOKENSPOUT_CACHE_SCOPE": "caller"})
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
    assert stop_server(server) == 0, server.log()


def test_a_chats_next_turn_takes_the_previous_answer_from_the_cache(shared):
    turns: list[str] = []
    for i, question in enumerate(["Where are the hammers?", "And the nails?", "Do you cut keys?"]):
        request = chat_request(*turns, question, salt="multi-turn")
        answer, usage = served(shared, request)
        history = pb.Chat(messages=request.chat.messages[:-1], add_generation_prompt=False)
        before = shared.Tokenize(pb.TokenizeRequest(chat=history)).count
        if i > 0:  # everything before the new question, the previous answer included, to the token: but for the
            # answer's last sampled token (never fed) and the end of turn the template writes after it
            assert before - 3 <= usage.cached_tokens <= before - 2, (i, before, usage)
        turns += [question, answer]
    status = shared.GetServerStatus(pb.GetServerStatusRequest())
    assert status.retiled_tokens_total == 0  # the answers' cells taken as decoded, never computed again


def test_salted_requests_share_cached_prefixes_only_within_their_salt(shared):
    assert served(shared, chat_request("Where is the paint?", salt="tenant-a"))[1].cached_tokens == 0
    assert served(shared, chat_request("Where is the timber?", salt="tenant-b"))[1].cached_tokens == 0
    assert served(shared, chat_request("Where is the glue?"))[1].cached_tokens == 0  # unsalted sees neither
    assert served(shared, chat_request("Where are the saws?", salt="tenant-a"))[1].cached_tokens > 60


def test_with_cache_scope_caller_one_caller_never_reaches_anothers_cells(per_caller):
    assert served(per_caller, chat_request("Where is the paint?"), "alice")[1].cached_tokens == 0
    assert served(per_caller, chat_request("Where is the timber?"), "bob")[1].cached_tokens == 0
    assert served(per_caller, chat_request("Where are the nails?"), "alice")[1].cached_tokens > 60  # its own
    # The same salt chosen by both callers: still each caller's own.
    assert served(per_caller, chat_request("Where is the glue?", salt="same"), "alice")[1].cached_tokens == 0
    assert served(per_caller, chat_request("Where are the saws?", salt="same"), "bob")[1].cached_tokens == 0
    assert served(per_caller, chat_request("Where are the hooks?", salt="same"), "alice")[1].cached_tokens > 60


def test_a_salt_too_long_is_invalid_argument_naming_the_field(shared):
    error = rpc_error(lambda: served(shared, chat_request("Hi", salt="s" * 257)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in bad_request_fields(error)
    unary = rpc_error(lambda: shared.Generate(pb.GenerateRequest(prompt="Hi", cache_salt="s" * 257), timeout=30))
    assert "cache_salt" in bad_request_fields(unary)


def test_the_salt_mixes_the_caller_in_so_no_choice_of_salt_reaches_another_caller():
    assert cache_salt(CacheScope.SHARED, "alice", "") == ""
    assert cache_salt(CacheScope.SHARED, "alice", "x") == cache_salt(CacheScope.SHARED, "bob", "x")
    assert cache_salt(CacheScope.CALLER, "alice", "") != cache_salt(CacheScope.CALLER, "bob", "")
    assert cache_salt(CacheScope.CALLER, "a", "bc") != cache_salt(CacheScope.CALLER, "ab", "c")
    assert cache_salt(CacheScope.CALLER, "alice", "x") != cache_salt(CacheScope.SHARED, "alice", "x")


def test_an_engine_without_salts_refuses_cache_salt_naming_the_field():
    from backend.exllama.engine import EXLLAMA_REQUEST_FEATURES
    from backend.types import ModelInfo
    from service.errors import ServiceError
    from service.validate import RequestValidator

    info = ModelInfo("m", "exllamav2", 4096, 32000, 8, 1, (2,), False, ("temperature",),
                     request_features=EXLLAMA_REQUEST_FEATURES)
    validator = RequestValidator(info)
    validator.params(pb.GenerateStreamRequest(prompt="a"))  # unsalted: served
    with pytest.raises(ServiceError) as refused:
        validator.params(pb.GenerateStreamRequest(prompt="a", cache_salt="tenant"))
    assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert [v.field for v in refused.value.violations] == ["cache_salt"]
