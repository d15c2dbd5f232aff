"""Tokenize: each token's byte and character offsets in the text, and several texts in one call.

The offsets must rebuild the text byte for byte, multi-byte characters included,
on the real model's tokenizer; hostile shapes (too many texts, too many bytes, a
million offsets) get documented statuses and leave other callers untouched.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from service.offsets import token_offsets
from tests.harness.helpers import bad_request_fields, greedy, rpc_error, stream
from tokenspout.v1 import generation_pb2 as pb

TEXTS = ["héllo 🙂 world", "日本語のテキスト", "plain ascii, with punctuation!", "a\u0301 ç\n\ttab", ""]


def _rebuilds(text: str, offsets: pb.TokenOffsets, pieces) -> None:
    data = text.encode()
    assert b"".join(data[s:e] for s, e in zip(offsets.byte_starts, offsets.byte_ends)) == data
    for start, end, piece in zip(offsets.byte_starts, offsets.byte_ends, pieces):
        assert data[start:end] == piece  # this model's pieces are exactly the text's bytes
    for (start, end), (c_start, c_end) in zip(zip(offsets.byte_starts, offsets.byte_ends),
                                              zip(offsets.char_starts, offsets.char_ends)):
        covered = text[c_start:c_end].encode()
        # The characters named cover the token's bytes (whole characters, so perhaps more).
        assert data[start:end] in covered or start == end
        assert len(covered) - (end - start) <= 6
    assert max(offsets.char_ends, default=0) == len(text)


@pytest.mark.parametrize("text", TEXTS)
def test_offsets_rebuild_the_text_byte_for_byte(stub, text):
    response = stub.Tokenize(pb.TokenizeRequest(text=text, return_offsets=True), timeout=30)
    offsets = response.offsets
    assert len(offsets.byte_starts) == len(offsets.char_ends) == response.count
    _rebuilds(text, offsets, response.pieces)


def test_a_token_splitting_a_character_counts_the_whole_character(stub):
    text = "🙂🙃😀 emoji"
    response = stub.Tokenize(pb.TokenizeRequest(text=text, return_offsets=True, add_special_tokens=False), timeout=30)
    offsets = response.offsets
    split = [i for i, piece in enumerate(response.pieces) if piece and not _is_utf8(piece)]
    assert split, "this text should have tokens holding part of a character"
    for i in split:
        assert offsets.char_ends[i] > offsets.char_starts[i]
    _rebuilds(text, offsets, response.pieces)


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_several_texts_in_one_call_match_one_call_each(stub):
    response = stub.Tokenize(pb.TokenizeRequest(texts=TEXTS, return_offsets=True), timeout=30)
    assert response.count == 0 and not response.token_ids
    assert len(response.results) == len(TEXTS)
    for text, result in zip(TEXTS, response.results):
        alone = stub.Tokenize(pb.TokenizeRequest(text=text, return_offsets=True), timeout=30)
        assert list(result.token_ids) == list(alone.token_ids) and result.count == alone.count
        assert list(result.pieces) == list(alone.pieces)
        assert result.offsets == alone.offsets
        _rebuilds(text, result.offsets, result.pieces)
    plain = stub.Tokenize(pb.TokenizeRequest(texts=TEXTS, add_special_tokens=False), timeout=30)
    assert not plain.results[0].HasField("offsets")
    alone = stub.Tokenize(pb.TokenizeRequest(text=TEXTS[0], add_special_tokens=False), timeout=30)
    assert list(plain.results[0].token_ids) == list(alone.token_ids)


def test_hostile_tokenize_shapes_get_documented_statuses(stub):
    too_many = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(texts=["x"] * 65), timeout=10))
    assert too_many.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts" in bad_request_fields(too_many)
    both = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(text="a", texts=["b"]), timeout=10))
    assert both.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts" in bad_request_fields(both)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    offsets_of_chat = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(chat=chat, return_offsets=True), timeout=10))
    assert "return_offsets" in bad_request_fields(offsets_of_chat)
    big = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(texts=["é" * 300_000] * 2), timeout=30))
    assert big.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts" in bad_request_fields(big)
    for error in (too_many, both, offsets_of_chat, big):
        assert len(error.details()) < 1024
    # Empty: no texts at all is an empty text, and empty texts have no tokens.
    assert stub.Tokenize(pb.TokenizeRequest(add_special_tokens=False), timeout=10).count == 0
    empty = stub.Tokenize(pb.TokenizeRequest(texts=["", ""], return_offsets=True, add_special_tokens=False), timeout=10)
    assert [r.count for r in empty.results] == [0, 0]


def test_a_million_offsets_are_answered_and_other_callers_go_on(fake_server):
    """A 1 MiB text the fake engine tokenizes byte by byte: a million tokens with their offsets."""
    text = "é" * 500_000 + "x" * ((1 << 20) - 1_000_000)
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(fake_server.address, options=options) as channel, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        from tokenspout.v1 import generation_pb2_grpc as pb_grpc
        stub = pb_grpc.GenerationServiceStub(channel)
        big = pool.submit(lambda: stub.Tokenize(pb.TokenizeRequest(text=text, return_offsets=True), timeout=120))
        assert stream(stub, greedy("Hello", max_new_tokens=4))[-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS
        response = big.result()
    assert response.count == len(text.encode()) + 1  # BOS and a token per byte
    assert len(response.offsets.byte_ends) == response.count and response.offsets.byte_ends[-1] == len(text.encode())
    assert response.offsets.char_ends[-1] == len(text)
    assert response.offsets.char_starts[2] == response.offsets.char_starts[1] == 0  # é's two bytes: one character


def test_token_offsets_match_sentencepiece_leading_space_and_control_tokens():
    data = b"Hi there"
    offsets = token_offsets(data, [b"", b" Hi", b" there"])  # BOS, then pieces with SentencePiece's space
    assert offsets.byte_starts == [0, 0, 2] and offsets.byte_ends == [0, 2, 8]
    assert offsets.char_starts == [0, 0, 2] and offsets.char_ends == [0, 2, 8]
    split = token_offsets("aé".encode(), [b"a\xc3", b"\xa9"])
    assert split.byte_ends == [2, 3] and split.char_starts == [0, 1] and split.char_ends == [2, 2]
