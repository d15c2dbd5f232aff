"""The affinity key (clients/python/tokenspout/affinity.py): the shared test vectors, and the
header both Python clients send with each generation (to a bare gRPC server that records it)."""

from __future__ import annotations

import asyncio
import json
from concurrent import futures

import grpc
import pytest

from tests.harness.servers import ROOT
from tokenspout import AsyncClient, Client, TokenspoutError
from tokenspout.affinity import HEADER, chat_key, prompt_key, session_key, token_ids_key

VECTORS = json.loads((ROOT / "clients" / "affinity-vectors.json").read_text())


def key_of(case: dict) -> str:
    if "session_id" in case:
        return session_key(case["session_id"])
    if "messages" in case:
        return chat_key([(m["role"], m["content"]) for m in case["messages"]])
    if "token_ids" in case:
        return token_ids_key(case["token_ids"])
    return prompt_key(case["prompt"])


@pytest.mark.parametrize("case", VECTORS["cases"], ids=[c["name"] for c in VECTORS["cases"]])
def test_the_shared_vectors(case):
    assert key_of(case) == case["key"]


def test_a_chat_keeps_its_key_from_turn_to_turn_and_chats_differ():
    first = [("system", "Be brief."), ("user", "Name a sea.")]
    later = [*first, ("assistant", "The Baltic."), ("user", "Another?")]
    assert chat_key(first) == chat_key(later)
    assert chat_key(first) != chat_key([("system", "Be brief."), ("user", "Name a river.")])
    assert prompt_key("x" * 256) == prompt_key("x" * 256 + "y") != prompt_key("x" * 255 + "y")


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "ünï"])
def test_a_session_id_must_fit_a_header(bad):
    with pytest.raises(ValueError, match="session_id"):
        session_key(bad)


class _Recorder(grpc.GenericRpcHandler):
    """Records each call's metadata and refuses it."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def service(self, details):
        self.seen.append(dict(details.invocation_metadata))

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "recorder")

        return grpc.unary_unary_rpc_method_handler(refuse) if details.method.endswith("/Generate") else (
            grpc.unary_stream_rpc_method_handler(refuse))


@pytest.fixture
def recorder():
    handler = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield handler, f"127.0.0.1:{port}"
    server.stop(0)


def test_both_clients_send_the_key(recorder):
    handler, address = recorder
    chat = [{"role": "user", "content": "Name a sea."}]
    with Client(address, retry=0) as client:
        for call in (lambda: client.generate("Hello"), lambda: client.stream(messages=chat).result(),
                     lambda: client.generate("Hello", session_id="s-1")):
            with pytest.raises(TokenspoutError):
                call()
    with Client(address, retry=0, affinity=False) as client, pytest.raises(TokenspoutError):
        client.generate("Hello")

    async def async_calls():
        async with AsyncClient(address, retry=0) as client:
            with pytest.raises(TokenspoutError):
                await client.stream("Hello", session_id="s-2").result()

    asyncio.run(async_calls())
    keys = [seen.get(HEADER) for seen in handler.seen]
    assert keys == [prompt_key("Hello"), chat_key([("user", "Name a sea.")]), "s-1", None, "s-2"]
