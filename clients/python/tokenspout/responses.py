"""What the server answers, as plain dataclasses built from the response messages.

Field names are the proto's. Fields the proto marks optional, and sub-messages that are not set,
are None here; enums are lower-case names ("max_tokens", not FINISH_REASON_MAX_TOKENS).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    """Of completion_tokens, the ones spent on reasoning."""


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; send it back in the assistant's Message, and its result with its id."""

    id: str = ""
    name: str = ""
    arguments: str = ""
    """A JSON object, as text."""

    def parsed_arguments(self) -> dict[str, Any]:
        return json.loads(self.arguments)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a call as it forms: its first carries id and name, the rest more of its arguments."""

    index: int = 0
    id: str = ""
    name: str = ""
    arguments_delta: str = ""


@dataclass(frozen=True)
class Timings:
    queue_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    tokens_per_second: float = 0.0
    constraint_compile_ms: float = 0.0
    constraint_mask_ms: float = 0.0


@dataclass(frozen=True)
class Finish:
    reason: str = "unspecified"
    stop_sequence: str | None = None
    stop_token_id: int | None = None
    seed: int = 0
    usage: Usage | None = None
    timings: Timings | None = None
    constraint_satisfied: bool | None = None
    constraint_message: str = ""


@dataclass(frozen=True)
class TopLogprob:
    id: int = 0
    text: str = ""
    logprob: float = 0.0


@dataclass(frozen=True)
class Token:
    id: int = 0
    text: str = ""
    bytes: builtins.bytes = b""
    logprob: float | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class _SampleOutput:
    """What a chunk, a sample and a whole generation each carry of one sample's output."""

    index: int = 0
    """The sample (0 to n - 1)."""
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    generated_tokens: int = 0
    finish: Finish | None = None
    reasoning: str = ""
    """Reasoning text, apart from `text`."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The calls the model made (a chunk's: those completed in it); finish.reason is then "tool_calls"."""


@dataclass(frozen=True)
class _CallOutput(_SampleOutput):
    """What a chunk and a whole generation carry of the call besides."""

    request_id: str = ""
    input_tokens: int = 0
    prompt_tokens: list[Token] = field(default_factory=list)
    truncated_input_tokens: int = 0


@dataclass(frozen=True)
class Chunk(_CallOutput):
    """One streamed message: new text, and `finish` on the last one (of its sample: see `index`)."""

    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Sample(_SampleOutput):
    """One of n samples of a generation."""


@dataclass(frozen=True)
class Generation(_CallOutput):
    """A whole generation (from generate(), or a stream's `result()`): its first sample, and every one with n > 1."""

    samples: list[Sample] = field(default_factory=list)
    """With n > 1: every sample, the first one (the fields above) included."""

    def parse(self, model: type[T]) -> T:
        """The text validated into a pydantic model (for a json_schema= generation)."""
        return model.model_validate_json(self.text)  # type: ignore[attr-defined, no-any-return]


@dataclass(frozen=True)
class TokenOffsets:
    """Token i covers bytes [byte_starts[i], byte_ends[i]) of the text's UTF-8, characters [char_starts[i], char_ends[i])."""

    byte_starts: list[int] = field(default_factory=list)
    byte_ends: list[int] = field(default_factory=list)
    char_starts: list[int] = field(default_factory=list)
    char_ends: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    count: int = 0
    offsets: TokenOffsets | None = None


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    count: int = 0
    offsets: TokenOffsets | None = None
    results: list[TokenizeResult] = field(default_factory=list)
    """For texts=: one result per text, in order."""


@dataclass(frozen=True)
class Compiled:
    compile_ms: float = 0.0
    cached: bool = False
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Cancelled:
    cancelled: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None


@dataclass(frozen=True)
class Limits:
    max_batch_size: int = 0
    max_new_tokens: int = 0
    max_stop_sequences: int = 0
    max_stop_sequence_length: int = 0
    max_top_logprobs: int = 0
    max_logit_bias_entries: int = 0
    max_samples: int = 0
    max_tokenize_texts: int = 0


@dataclass(frozen=True)
class ModelInfo:
    model_id: str = ""
    engine: str = ""
    context_length: int = 0
    vocab_size: int = 0
    special_tokens: SpecialTokens | None = None
    samplers: list[str] = field(default_factory=list)
    constraint_kinds: list[str] = field(default_factory=list)
    limits: Limits | None = None
    has_chat_template: bool = False
    quantization: str = ""
    request_features: list[str] = field(default_factory=list)
    tool_call_format: str = ""
    template_renders_tools: bool = False
    reasoning_format: str = ""


@dataclass(frozen=True)
class CallerStatus:
    """One caller's share of the server (see the proto's CallerStatus)."""

    caller: str = ""
    running_sequences: int = 0
    queued_requests: int = 0
    preempted_sequences: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    preempted_total: int = 0
    refused_total: int = 0
    shed_total: int = 0
    queue_timeouts_total: int = 0
    weight: float = 0.0


@dataclass(frozen=True)
class ServerStatus:
    running_sequences: int = 0
    queued_requests: int = 0
    paused_sequences: int = 0
    cache_tokens_used: int = 0
    cache_tokens_free: int = 0
    max_batch_size: int = 0
    max_queued_requests: int = 0
    engine_steps: int = 0
    cancelled_total: int = 0
    last_cancel_latency_steps: int = 0
    last_cancel_latency_ms: float = 0.0
    max_cancel_latency_steps: int = 0
    rejected_total: int = 0
    draining: bool = False
    started_total: int = 0
    callers: list[CallerStatus] = field(default_factory=list)
    """Per caller (fairness key), the busiest first."""


@functools.cache
def _nested_classes(cls: type) -> dict[str, type]:
    """Field name -> the dataclass it holds (alone or in a list)."""
    nested: dict[str, type] = {}
    for name, hint in typing.get_type_hints(cls).items():
        for candidate in (hint, *typing.get_args(hint)):
            inner = typing.get_args(candidate) or (candidate,)
            dataclass_types = [t for t in inner if isinstance(t, type) and dataclasses.is_dataclass(t)]
            if dataclass_types:
                nested[name] = dataclass_types[0]
    return nested


@functools.cache
def _plan(cls: type, descriptor: Any) -> list[tuple[str, str, Any]]:
    """How to copy each field of `cls` from messages of `descriptor`: (name, how, detail), worked
    out once per class, since streams convert one message per token."""
    nested = _nested_classes(cls)
    plan: list[tuple[str, str, Any]] = []
    for f in dataclasses.fields(cls):
        field_descriptor = descriptor.fields_by_name.get(f.name)
        if field_descriptor is None:
            continue
        if field_descriptor.is_repeated:
            plan.append((f.name, "list", nested.get(f.name)))
        elif f.name in nested:
            plan.append((f.name, "message", nested[f.name]))
        elif field_descriptor.enum_type is not None:
            enum = field_descriptor.enum_type
            prefix = _enum_prefix(enum.name)
            names = {v.number: v.name.removeprefix(prefix).lower() for v in enum.values}
            plan.append((f.name, "enum", names))
        else:
            plan.append((f.name, "optional" if field_descriptor.has_presence else "scalar", None))
    return plan


def from_proto(cls: type[T], message: Any) -> T:
    """Builds `cls` from a message with the same field names; fields the proto lacks keep defaults."""
    values: dict[str, Any] = {}
    plain_class: type = cls  # a class, so hashable for _plan's cache
    for name, how, detail in _plan(plain_class, message.DESCRIPTOR):
        value = getattr(message, name)
        if how == "scalar":
            values[name] = value
        elif how == "list":
            values[name] = [from_proto(detail, v) for v in value] if detail else list(value)
        elif how == "message":
            values[name] = from_proto(detail, value) if message.HasField(name) else None
        elif how == "optional":
            values[name] = value if message.HasField(name) else None
        else:
            values[name] = detail.get(value, str(value))
    return cls(**values)


def _enum_prefix(enum_name: str) -> str:
    # FinishReason -> FINISH_REASON_ (buf's ENUM_VALUE_PREFIX rule guarantees it).
    return "".join("_" + c if c.isupper() else c.upper() for c in enum_name).lstrip("_") + "_"
