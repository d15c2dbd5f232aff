"""Hypothesis strategies for requests a hostile or careless caller might send.

Every field of GenerateStreamRequest is drawn, with the extremes mixed in:
NaN and infinite floats, the largest integers, huge repeated fields and maps,
odd Unicode, and constraints known to be pathological. Shared by
tests/service/test_fuzz.py and bench/suite/hostile.py.
"""

from __future__ import annotations

import json

import grpc
from hypothesis import strategies as st

from tokenspout.v1 import generation_pb2 as pb

ALLOWED_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.CANCELLED,  # the fuzzer itself stops long streams
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""What a caller may be answered: never UNKNOWN, never INTERNAL."""

MAX_ERROR_BYTES = 4096

UINT32_MAX = 2**32 - 1



def mostly(sane: st.SearchStrategy, extreme: st.SearchStrategy) -> st.SearchStrategy:
    """Sane values three times in four, so requests often get past validation into generation."""
    return st.sampled_from((sane, sane, sane, extreme)).flatmap(lambda strategy: strategy)


floats = mostly(
    st.floats(0.0, 2.0),
    st.one_of(
        st.floats(width=32),  # NaN and infinities included
        st.sampled_from([-0.0, -1.0, 1e-45, 3.4e38, -3.4e38, float("nan"), float("inf"), float("-inf")]),
    ),
)
uint32 = mostly(st.integers(0, 16), st.one_of(st.integers(0, UINT32_MAX), st.just(UINT32_MAX)))
int32 = mostly(st.integers(0, 49_000), st.integers(-(2**31), 2**31 - 1))
plain_text = st.sampled_from(["Hello", "The capital of France is", "Count: 1, 2,", "JSON:", "Output:", "日本語で"])
odd_text = mostly(
    plain_text,
    st.one_of(
        st.text(max_size=40),
        st.text(st.characters(codec="utf-8", min_codepoint=0x80), max_size=20),
        st.sampled_from(["", "\x00", "\u202e", "\U0004392e\uf3fd", "<|im_end|>", "\n\r\t", "🙂" * 50]),
        st.integers(1_000, 70_000).map(lambda n: "word " * n),
    ),
)

VALID_REGEXES = ["[0-9]{3}-[0-9]{4}", "(yes|no)", "[a-z ]{1,20}\\.", "\\p{L}{1,8}"]
VALID_GRAMMARS = ['start: "(" WORD ("," WORD)* ")"\nWORD: /[a-z]{1,6}/', 'start: "a" start | "b"']
VALID_SCHEMAS = [
    '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}',
    '{"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}',
    '{"type": "string", "pattern": "^\\\\p{L}+$", "maxLength": 8}',
    '{"enum": ["red", "green", 3, null]}',
    '{"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}',
]
PATHOLOGICAL_REGEXES = [
    "a\\", "a{1000000}", "(a|a)*b", "(a*)*b", "[", "(?P<x>a)(?P=x)", "\\p{L}+", ".*", "a{2,1}", "\\b", "(?=a)a", "",
]
PATHOLOGICAL_GRAMMARS = [
    "start: start",
    'start: "a"{1000000}',
    "start: " + " | ".join(f'"w{i}"' for i in range(3000)),
    "start: x\nx: ",
    'start: "a" start | "b"',
    "%ignore",
    "",
]
PATHOLOGICAL_SCHEMAS = [
    "[" * 2000 + "]" * 2000,
    '{"type": "object", "not": {}}',
    '{"type": "string", "pattern": "^\\\\p{L}+$"}',
    '{"type": "string", "pattern": "^a\\\\z"}',
    '{"$ref": "https://example.invalid/x.json"}',
    '{"type": "array", "minItems": 1000000}',
    '{"type": "string", "minLength": 100000}',
    "true",
    "false",
    "null",
    "{",
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}),
]


@st.composite
def constraints(draw) -> pb.Constraint:
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "grammar", "choice"]))
    constraint = pb.Constraint()
    if kind == "json_schema":
        constraint.json_schema = draw(st.sampled_from(VALID_SCHEMAS + PATHOLOGICAL_SCHEMAS) | odd_text)
    elif kind == "json_object":
        constraint.json_object = draw(st.booleans())
    elif kind == "regex":
        constraint.regex = draw(st.sampled_from(VALID_REGEXES + PATHOLOGICAL_REGEXES) | odd_text)
    elif kind == "grammar":
        constraint.grammar = draw(st.sampled_from(VALID_GRAMMARS + PATHOLOGICAL_GRAMMARS) | odd_text)
    else:
        constraint.choice.values.extend(draw(st.lists(odd_text, max_size=draw(mostly(st.just(3), st.just(2000))))))
    if draw(st.booleans()):
        constraint.strict = draw(st.booleans())
    constraint.whitespace_flexible = draw(st.booleans())
    if draw(st.booleans()):
        constraint.max_whitespace = draw(uint32)
    return constraint


def _set_some(draw, message, fields: dict) -> None:
    for name, strategy in fields.items():
        if draw(st.booleans()):
            setattr(message, name, draw(strategy))


@st.composite
def sampling(draw) -> pb.SamplingParams:
    params = pb.SamplingParams()
    float_fields = [
        "temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "top_a", "tfs", "skew", "smoothing_factor",
    ]
    _set_some(draw, params, {name: floats for name in float_fields})
    _set_some(draw, params, {"top_k": uint32, "penalty_last_n": uint32, "token_healing": st.booleans()})
    if draw(st.booleans()):
        params.seed = draw(st.integers(0, 2**64 - 1))
    bias = draw(st.dictionaries(int32, floats, max_size=draw(mostly(st.just(4), st.just(3000)))))
    for token, value in bias.items():
        params.logit_bias[token] = value
    params.banned_strings.extend(draw(st.lists(odd_text, max_size=draw(mostly(st.just(2), st.just(300))))))
    if draw(st.booleans()):
        _set_some(draw, params.dry, {"multiplier": floats, "base": floats, "allowed_length": uint32, "penalty_last_n": uint32})
        params.dry.sequence_breakers.extend(draw(st.lists(odd_text, max_size=40)))
    if draw(st.booleans()):
        _set_some(draw, params.xtc, {"probability": floats, "threshold": floats})
    if draw(st.booleans()):
        _set_some(draw, params.mirostat, {"tau": floats, "eta": floats})
    return params


@st.composite
def stopping(draw) -> pb.StoppingCriteria:
    criteria = pb.StoppingCriteria()
    _set_some(draw, criteria, {
        "max_new_tokens": uint32, "min_new_tokens": uint32, "include_stop_sequence": st.booleans(),
        "ignore_eos": st.booleans(), "time_limit_ms": uint32,
    })
    criteria.stop_sequences.extend(draw(st.lists(odd_text, max_size=draw(mostly(st.just(3), st.just(300))))))
    criteria.stop_token_ids.extend(draw(st.lists(int32, max_size=draw(mostly(st.just(3), st.just(3000))))))
    return criteria


@st.composite
def output(draw) -> pb.OutputOptions:
    options = pb.OutputOptions()
    _set_some(draw, options, {
        "max_tokens_per_message": uint32, "return_token_ids": st.booleans(), "return_logprobs": st.booleans(),
        "top_logprobs": uint32, "heartbeat_interval_ms": uint32, "min_tokens_per_message": uint32,
        "flush_interval_ms": uint32, "prompt_logprobs": st.booleans(), "prompt_top_logprobs": uint32,
    })
    return options


@st.composite
def chats(draw) -> pb.Chat:
    roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), odd_text)
    messages = draw(
        st.lists(st.builds(pb.ChatMessage, role=roles, content=odd_text), max_size=draw(mostly(st.just(4), st.just(500))))
    )
    chat = pb.Chat(messages=messages)
    if draw(st.booleans()):
        chat.add_generation_prompt = draw(st.booleans())
    return chat


token_ids = st.one_of(
    st.lists(st.integers(0, 49_151), min_size=1, max_size=40),
    st.lists(int32, max_size=40),  # ids out of range, negative ones
    st.integers(1_000, 300_000).map(lambda n: [17] * n),  # past the context, past max_input_bytes
    st.integers(1_000, 300_000).map(lambda n: [2**31 - 1] * n),  # a flood of bad ids
)


@st.composite
def tokenize_requests(draw) -> pb.TokenizeRequest:
    """Tokenize calls: a text, a chat, or a batch of texts (none, many, huge), with or without offsets."""
    request = pb.TokenizeRequest(model=draw(mostly(st.just(""), odd_text)), return_offsets=draw(st.booleans()))
    shape = draw(st.sampled_from(["text", "chat", "texts", "both", "none"]))
    if shape in ("text", "both"):
        request.text = draw(odd_text)
    if shape == "chat":
        request.chat.CopyFrom(draw(chats()))
    if shape in ("texts", "both"):
        request.texts.extend(draw(st.lists(odd_text, max_size=draw(mostly(st.just(4), st.just(200))))))
    if draw(st.booleans()):
        request.add_special_tokens = draw(st.booleans())
    return request


@st.composite
def generate_requests(draw) -> pb.GenerateStreamRequest:
    request = pb.GenerateStreamRequest(
        request_id=draw(st.one_of(st.just(""), odd_text)),
        model=draw(mostly(st.just(""), st.sampled_from(["default", "gpt-4", "m" * 16_384]) | odd_text)),
    )
    if draw(st.booleans()):
        request.prompt = draw(odd_text)
    elif draw(st.booleans()):
        request.prompt_token_ids.ids.extend(draw(token_ids))
    elif draw(mostly(st.just(True), st.just(False))):
        request.chat.CopyFrom(draw(chats()))
    _set_some(draw, request, {"n": uint32, "truncate_input_tokens": uint32})
    for name, strategy in (("sampling", sampling()), ("stopping", stopping()), ("output", output())):
        if draw(st.booleans()):
            getattr(request, name).CopyFrom(draw(strategy))
    if draw(st.booleans()):
        request.constraint.CopyFrom(draw(constraints()))
    return request


raw_bytes = st.one_of(
    st.binary(max_size=256),
    st.sampled_from([b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", b"\x1a\x05ab", b"\x08" * 20, b"\x3a\x80\x80\x80\x80\x10"]),
)
"""Bytes that are mostly not a valid message of any type."""
