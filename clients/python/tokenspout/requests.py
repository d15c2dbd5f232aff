"""What a caller may ask for, as small dataclasses, and their translation into request messages.

Field names are the proto's, so the proto comments in protos/tokenspout/v1/generation.proto
document them. `None` means "the server's default"; each dataclass converts field by field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from tokenspout.responses import ToolCall
from tokenspout.v1 import generation_pb2 as pb

JsonSchema = str | Mapping[str, Any] | type
"""A JSON Schema as a JSON string, a dict, or a pydantic model class."""


@dataclass(frozen=True)
class Dry:
    multiplier: float | None = None
    base: float | None = None
    allowed_length: int | None = None
    penalty_last_n: int | None = None
    sequence_breakers: Sequence[str] = ()


@dataclass(frozen=True)
class Xtc:
    probability: float | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class Mirostat:
    tau: float | None = None
    eta: float | None = None


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    penalty_last_n: int | None = None
    dry: Dry | None = None
    xtc: Xtc | None = None
    mirostat: Mirostat | None = None
    top_a: float | None = None
    tfs: float | None = None
    skew: float | None = None
    smoothing_factor: float | None = None
    banned_strings: Sequence[str] = ()
    token_healing: bool = False


@dataclass(frozen=True)
class Stopping:
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop_sequences: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    include_stop_sequence: bool | None = None
    ignore_eos: bool = False
    time_limit_ms: int = 0


@dataclass(frozen=True)
class Constraint:
    """Exactly one kind: json_schema, json_object, regex, grammar or choice."""

    json_schema: JsonSchema | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    strict: bool | None = None
    whitespace_flexible: bool = False
    max_whitespace: int | None = None

    def __post_init__(self) -> None:
        kinds = [self.json_schema is not None, self.json_object, self.regex is not None]
        kinds += [self.grammar is not None, self.choice is not None]
        if sum(kinds) != 1:
            raise ValueError("a Constraint takes exactly one of json_schema, json_object, regex, grammar, choice")

    def to_proto(self) -> pb.Constraint:
        message = pb.Constraint(whitespace_flexible=self.whitespace_flexible)
        if self.json_schema is not None:
            message.json_schema = schema_text(self.json_schema)
        elif self.json_object:
            message.json_object = True
        elif self.regex is not None:
            message.regex = self.regex
        elif self.grammar is not None:
            message.grammar = self.grammar
        else:
            message.choice.values.extend(self.choice or ())
        if self.strict is not None:
            message.strict = self.strict
        if self.max_whitespace is not None:
            message.max_whitespace = self.max_whitespace
        return message


@dataclass(frozen=True)
class Output:
    max_tokens_per_message: int = 0
    return_token_ids: bool = False
    return_logprobs: bool = False
    top_logprobs: int = 0
    heartbeat_interval_ms: int = 0
    min_tokens_per_message: int = 0
    flush_interval_ms: int = 0
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: Sequence[ToolCall] = ()
    """An assistant's calls (as a Generation's tool_calls returned them)."""
    tool_call_id: str = ""
    """A "tool" message: the id of the call whose result `content` is."""
    reasoning: str = ""

    @classmethod
    def tool_result(cls, call: ToolCall, result: str | object) -> Message:
        """The "tool" message answering `call`: a string as is, anything else as JSON."""
        return cls("tool", result if isinstance(result, str) else json.dumps(result), tool_call_id=call.id)


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is its arguments' JSON Schema (a dict, text or pydantic model)."""

    name: str
    description: str = ""
    parameters: JsonSchema | None = None

    def to_proto(self) -> pb.Tool:
        return pb.Tool(name=self.name, description=self.description,
                       parameters=schema_text(self.parameters) if self.parameters is not None else "")


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of stream() and generate().

    The shortcuts (max_new_tokens, temperature, seed, stop, json_schema, regex, grammar, choices)
    fill the matching field of `sampling`, `stopping` or `constraint`, which cover every field.
    """

    messages: Sequence[Message | Mapping[str, str]]
    add_generation_prompt: bool
    tools: Sequence[Tool]
    """Functions the model may call (with messages=); calls come back in tool_calls."""
    tool_choice: str
    """"auto" (the default with tools), "none", "required", or a tool's name (that tool must be called)."""
    parallel_tool_calls: bool
    """Allow several calls in one turn (default true)."""
    reasoning: str
    """"on" (think first, in `reasoning`; a constraint applies after it) or "off"; unset: the model's default."""
    reasoning_budget_tokens: int
    """Most reasoning tokens; then the end of reasoning is forced."""
    prompt_token_ids: Sequence[int]
    """Token ids as the input, instead of a prompt or messages (no BOS is added)."""
    n: int
    """How many samples of the prompt (default 1); chunks carry their sample's `index`."""
    truncate_input_tokens: int
    """Keep only the last this many prompt tokens (a chat drops whole messages); 0: keep all."""
    max_new_tokens: int
    temperature: float
    seed: int
    stop: Sequence[str]
    json_schema: JsonSchema
    regex: str
    grammar: str
    choices: Sequence[str]
    sampling: Sampling
    stopping: Stopping
    constraint: Constraint
    output: Output
    request_id: str
    model: str
    timeout: float
    priority: int
    """Higher is more urgent (default 0); negative is sheddable. See the proto's comment."""
    queue_timeout_ms: int
    """Give up with UnavailableError (QUEUE_TIMEOUT) if not started this long after arrival (0: no limit)."""
    session_id: str
    """The affinity key to send instead of one derived from the input (tokenspout.affinity): calls
    with the same session id go to the same replica behind Envoy or HAProxy."""


def schema_text(schema: JsonSchema) -> str:
    """A JSON Schema as the JSON string the proto carries."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, type):
        model_json_schema = getattr(schema, "model_json_schema", None)
        if model_json_schema is None:
            raise TypeError(f"{schema.__name__} is not a pydantic model class (no model_json_schema)")
        return json.dumps(model_json_schema())
    return json.dumps(schema)


def fill(message: Any, options: Any) -> None:
    """Copies a dataclass onto a message of the same field names, skipping unset (None) fields."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            fill(getattr(message, f.name), value)
        elif isinstance(value, Mapping):
            getattr(message, f.name).update(value)
        elif isinstance(value, (list, tuple)):
            getattr(message, f.name).extend(value)
        else:
            setattr(message, f.name, value)


def chat_message(message: Message | Mapping[str, Any]) -> pb.ChatMessage:
    if not isinstance(message, Message):
        calls = tuple(call if isinstance(call, ToolCall) else ToolCall(**call) for call in message.get("tool_calls", ()))
        message = Message(message["role"], message.get("content", ""), calls,
                          message.get("tool_call_id", ""), message.get("reasoning", ""))
    return pb.ChatMessage(
        role=message.role, content=message.content, tool_call_id=message.tool_call_id, reasoning=message.reasoning,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls],
    )


def fill_chat(chat: pb.Chat, options: GenerateOptions) -> None:
    """Tools, tool choice and reasoning onto a chat request."""
    chat.tools.extend(tool.to_proto() for tool in options.get("tools", ()))
    choice = options.get("tool_choice")
    if choice in _TOOL_CHOICES:
        chat.tool_choice.mode = _TOOL_CHOICES[choice]
    elif choice is not None:
        chat.tool_choice.name = choice
    if "parallel_tool_calls" in options:
        chat.parallel_tool_calls = options["parallel_tool_calls"]
    reasoning = options.get("reasoning")
    if reasoning is not None:
        chat.reasoning.mode = pb.REASONING_MODE_ON if reasoning == "on" else pb.REASONING_MODE_OFF
    if "reasoning_budget_tokens" in options:
        chat.reasoning.budget_tokens = options["reasoning_budget_tokens"]


_TOOL_CHOICES = {"auto": pb.TOOL_CHOICE_MODE_AUTO, "none": pb.TOOL_CHOICE_MODE_NONE,
                 "required": pb.TOOL_CHOICE_MODE_REQUIRED}


def constraint_of(
    constraint: Constraint | None = None,
    *,
    json_schema: JsonSchema | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choices: Sequence[str] | None = None,
) -> Constraint | None:
    """The constraint from either the dataclass or one shortcut (not both)."""
    shortcuts = {"json_schema": json_schema, "regex": regex, "grammar": grammar, "choice": choices}
    given = {name: value for name, value in shortcuts.items() if value is not None}
    if not given:
        return constraint
    if constraint is not None or len(given) > 1:
        raise ValueError("give one constraint: `constraint=` or one of json_schema/regex/grammar/choices")
    return Constraint(json_schema=json_schema, regex=regex, grammar=grammar, choice=choices)  # the one given


def generate_request(message_class: type, prompt: str | None, options: GenerateOptions) -> Any:
    """Builds a GenerateStreamRequest or GenerateRequest (same fields) from stream()/generate() arguments."""
    messages = options.get("messages")
    token_ids = options.get("prompt_token_ids")
    if sum(given is not None for given in (prompt, messages, token_ids)) != 1:
        raise ValueError("give one of a prompt, messages= or prompt_token_ids=")
    request = message_class(
        request_id=options.get("request_id", ""), model=options.get("model", ""),
        priority=options.get("priority", 0), queue_timeout_ms=options.get("queue_timeout_ms", 0),
        n=options.get("n", 0), truncate_input_tokens=options.get("truncate_input_tokens", 0),
    )
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.prompt_token_ids.ids.extend(token_ids)
    else:
        request.chat.messages.extend(chat_message(m) for m in messages or ())
        fill_chat(request.chat, options)
        if "add_generation_prompt" in options:
            request.chat.add_generation_prompt = options["add_generation_prompt"]

    sampling = options.get("sampling", Sampling())
    if "temperature" in options:
        sampling = dataclasses.replace(sampling, temperature=options["temperature"])
    if "seed" in options:
        sampling = dataclasses.replace(sampling, seed=options["seed"])
    fill(request.sampling, sampling)

    stopping = options.get("stopping", Stopping())
    if "max_new_tokens" in options:
        stopping = dataclasses.replace(stopping, max_new_tokens=options["max_new_tokens"])
    if "stop" in options:
        stopping = dataclasses.replace(stopping, stop_sequences=tuple(options["stop"]))
    fill(request.stopping, stopping)

    constraint = constraint_of(
        options.get("constraint"),
        json_schema=options.get("json_schema"),
        regex=options.get("regex"),
        grammar=options.get("grammar"),
        choices=options.get("choices"),
    )
    if constraint is not None:
        request.constraint.CopyFrom(constraint.to_proto())
    if "output" in options:
        fill(request.output, options["output"])
    return request


def tokenize_request(
    text: str | None, messages: Sequence[Message | Mapping[str, str]] | None, add_special_tokens: bool | None, model: str,
    texts: Sequence[str] | None = None, return_offsets: bool = False,
) -> pb.TokenizeRequest:
    if sum(given is not None for given in (text, messages, texts)) != 1:
        raise ValueError("give one of text, messages= or texts=")
    request = pb.TokenizeRequest(model=model, return_offsets=return_offsets)
    if text is not None:
        request.text = text
    elif texts is not None:
        if not texts:
            raise ValueError("texts= needs at least one text")
        request.texts.extend(texts)
    else:
        request.chat.messages.extend(chat_message(m) for m in messages or ())
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def compile_request(constraint: Constraint | None, model: str, **shortcuts: Any) -> pb.CompileConstraintRequest:
    chosen = constraint_of(constraint, **shortcuts)
    if chosen is None:
        raise ValueError("give a constraint: `constraint=` or one of json_schema/regex/grammar/choices")
    return pb.CompileConstraintRequest(model=model, constraint=chosen.to_proto())


def cancel_request(request_ids: str | Sequence[str]) -> pb.CancelRequest:
    return pb.CancelRequest(request_ids=[request_ids] if isinstance(request_ids, str) else list(request_ids))
