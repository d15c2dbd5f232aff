from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_NGRAM: _ClassVar[SpeculationMode]
    SPECULATION_MODE_DRAFT_MODEL: _ClassVar[SpeculationMode]

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_UNSPECIFIED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]

class ReasoningMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASONING_MODE_UNSPECIFIED: _ClassVar[ReasoningMode]
    REASONING_MODE_OFF: _ClassVar[ReasoningMode]
    REASONING_MODE_ON: _ClassVar[ReasoningMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TOKENS: _ClassVar[FinishReason]
    FINISH_REASON_TIME_LIMIT: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LIMIT: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_CONSTRAINT_COMPLETE: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class PrefixReuse(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFIX_REUSE_UNSPECIFIED: _ClassVar[PrefixReuse]
    PREFIX_REUSE_OFF: _ClassVar[PrefixReuse]
    PREFIX_REUSE_AS_CACHED: _ClassVar[PrefixReuse]
    PREFIX_REUSE_EXACT: _ClassVar[PrefixReuse]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_NGRAM: SpeculationMode
SPECULATION_MODE_DRAFT_MODEL: SpeculationMode
TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
REASONING_MODE_UNSPECIFIED: ReasoningMode
REASONING_MODE_OFF: ReasoningMode
REASONING_MODE_ON: ReasoningMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_MAX_TOKENS: FinishReason
FINISH_REASON_TIME_LIMIT: FinishReason
FINISH_REASON_CONTEXT_LIMIT: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_CONSTRAINT_COMPLETE: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
PREFIX_REUSE_UNSPECIFIED: PrefixReuse
PREFIX_REUSE_OFF: PrefixReuse
PREFIX_REUSE_AS_CACHED: PrefixReuse
PREFIX_REUSE_EXACT: PrefixReuse

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "chat", "prompt_token_ids", "sampling", "stopping", "constraint", "output", "speculation", "priority", "queue_timeout_ms", "n", "truncate_input_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    chat: Chat
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    stopping: StoppingCriteria
    constraint: Constraint
    output: OutputOptions
    speculation: Speculation
    priority: int
    queue_timeout_ms: int
    n: int
    truncate_input_tokens: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., priority: _Optional[int] = ..., queue_timeout_ms: _Optional[int] = ..., n: _Optional[int] = ..., truncate_input_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "chat", "prompt_token_ids", "sampling", "stopping", "constraint", "output", "speculation", "priority", "queue_timeout_ms", "n", "truncate_input_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    chat: Chat
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    stopping: StoppingCriteria
    constraint: Constraint
    output: OutputOptions
    speculation: Speculation
    priority: int
    queue_timeout_ms: int
    n: int
    truncate_input_tokens: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., priority: _Optional[int] = ..., queue_timeout_ms: _Optional[int] = ..., n: _Optional[int] = ..., truncate_input_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("mode", "max_draft_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    max_draft_tokens: int
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., max_draft_tokens: _Optional[int] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls", "reasoning")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    reasoning: Reasoning
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., reasoning: _Optional[_Union[Reasoning, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    name: str
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments_delta")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_DELTA_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments_delta: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_delta: _Optional[str] = ...) -> None: ...

class Reasoning(_message.Message):
    __slots__ = ("mode", "budget_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: ReasoningMode
    budget_tokens: int
    def __init__(self, mode: _Optional[_Union[ReasoningMode, str]] = ..., budget_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logit_bias", "penalty_last_n", "dry", "xtc", "mirostat", "top_a", "tfs", "skew", "smoothing_factor", "banned_strings", "token_healing")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    DRY_FIELD_NUMBER: _ClassVar[int]
    XTC_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_FIELD_NUMBER: _ClassVar[int]
    TOP_A_FIELD_NUMBER: _ClassVar[int]
    TFS_FIELD_NUMBER: _ClassVar[int]
    SKEW_FIELD_NUMBER: _ClassVar[int]
    SMOOTHING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    BANNED_STRINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HEALING_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    penalty_last_n: int
    dry: DrySampler
    xtc: XtcSampler
    mirostat: MirostatSampler
    top_a: float
    tfs: float
    skew: float
    smoothing_factor: float
    banned_strings: _containers.RepeatedScalarFieldContainer[str]
    token_healing: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., penalty_last_n: _Optional[int] = ..., dry: _Optional[_Union[DrySampler, _Mapping]] = ..., xtc: _Optional[_Union[XtcSampler, _Mapping]] = ..., mirostat: _Optional[_Union[MirostatSampler, _Mapping]] = ..., top_a: _Optional[float] = ..., tfs: _Optional[float] = ..., skew: _Optional[float] = ..., smoothing_factor: _Optional[float] = ..., banned_strings: _Optional[_Iterable[str]] = ..., token_healing: _Optional[bool] = ...) -> None: ...

class DrySampler(_message.Message):
    __slots__ = ("multiplier", "base", "allowed_length", "penalty_last_n", "sequence_breakers")
    MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_BREAKERS_FIELD_NUMBER: _ClassVar[int]
    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int
    sequence_breakers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, multiplier: _Optional[float] = ..., base: _Optional[float] = ..., allowed_length: _Optional[int] = ..., penalty_last_n: _Optional[int] = ..., sequence_breakers: _Optional[_Iterable[str]] = ...) -> None: ...

class XtcSampler(_message.Message):
    __slots__ = ("probability", "threshold")
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    probability: float
    threshold: float
    def __init__(self, probability: _Optional[float] = ..., threshold: _Optional[float] = ...) -> None: ...

class MirostatSampler(_message.Message):
    __slots__ = ("tau", "eta")
    TAU_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    tau: float
    eta: float
    def __init__(self, tau: _Optional[float] = ..., eta: _Optional[float] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "stop_sequences", "stop_token_ids", "include_stop_sequence", "ignore_eos", "time_limit_ms")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_MS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_sequence: bool
    ignore_eos: bool
    time_limit_ms: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_sequence: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., time_limit_ms: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice", "strict", "whitespace_flexible", "max_whitespace")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_FLEXIBLE_FIELD_NUMBER: _ClassVar[int]
    MAX_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    strict: bool
    whitespace_flexible: bool
    max_whitespace: int
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., strict: _Optional[bool] = ..., whitespace_flexible: _Optional[bool] = ..., max_whitespace: _Optional[int] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("max_tokens_per_message", "return_token_ids", "return_logprobs", "top_logprobs", "heartbeat_interval_ms", "min_tokens_per_message", "flush_interval_ms", "prompt_logprobs", "prompt_top_logprobs")
    MAX_TOKENS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens_per_message: int
    return_token_ids: bool
    return_logprobs: bool
    top_logprobs: int
    heartbeat_interval_ms: int
    min_tokens_per_message: int
    flush_interval_ms: int
    prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, max_tokens_per_message: _Optional[int] = ..., return_token_ids: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., min_tokens_per_message: _Optional[int] = ..., flush_interval_ms: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "text", "tokens", "generated_tokens", "input_tokens", "finish", "heartbeat", "index", "prompt_tokens", "truncated_input_tokens", "samples", "reasoning", "tool_call_deltas", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_tokens: int
    input_tokens: int
    finish: Finish
    heartbeat: bool
    index: int
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    truncated_input_tokens: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    reasoning: str
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., input_tokens: _Optional[int] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., heartbeat: _Optional[bool] = ..., index: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., truncated_input_tokens: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., reasoning: _Optional[str] = ..., tool_call_deltas: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "tokens", "generated_tokens", "input_tokens", "finish", "heartbeat", "index", "prompt_tokens", "truncated_input_tokens", "samples", "reasoning", "tool_call_deltas", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_tokens: int
    input_tokens: int
    finish: Finish
    heartbeat: bool
    index: int
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    truncated_input_tokens: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    reasoning: str
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., input_tokens: _Optional[int] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., heartbeat: _Optional[bool] = ..., index: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., truncated_input_tokens: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., reasoning: _Optional[str] = ..., tool_call_deltas: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("index", "text", "tokens", "generated_tokens", "finish", "reasoning", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_tokens: int
    finish: Finish
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "bytes", "logprob", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    bytes: bytes
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "text", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "stop_sequence", "stop_token_id", "seed", "usage", "timings", "constraint_satisfied", "constraint_message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_SATISFIED_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    stop_sequence: str
    stop_token_id: int
    seed: int
    usage: Usage
    timings: Timings
    constraint_satisfied: bool
    constraint_message: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., stop_sequence: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., seed: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., constraint_satisfied: _Optional[bool] = ..., constraint_message: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens", "accepted_draft_tokens", "reasoning_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "time_to_first_token_ms", "prefill_ms", "decode_ms", "total_ms", "tokens_per_second", "constraint_compile_ms", "constraint_mask_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_MASK_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    time_to_first_token_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float
    tokens_per_second: float
    constraint_compile_ms: float
    constraint_mask_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., constraint_compile_ms: _Optional[float] = ..., constraint_mask_ms: _Optional[float] = ...) -> None: ...

class CompileConstraintRequest(_message.Message):
    __slots__ = ("model", "constraint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    constraint: Constraint
    def __init__(self, model: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class CompileConstraintResponse(_message.Message):
    __slots__ = ("compile_ms", "cached", "warnings")
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    compile_ms: float
    cached: bool
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, compile_ms: _Optional[float] = ..., cached: _Optional[bool] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_special_tokens", "return_offsets", "texts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: Chat
    add_special_tokens: bool
    return_offsets: bool
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., return_offsets: _Optional[bool] = ..., texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "pieces", "count", "offsets", "results")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    count: int
    offsets: TokenOffsets
    results: _containers.RepeatedCompositeFieldContainer[TokenizeResult]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[bytes]] = ..., count: _Optional[int] = ..., offsets: _Optional[_Union[TokenOffsets, _Mapping]] = ..., results: _Optional[_Iterable[_Union[TokenizeResult, _Mapping]]] = ...) -> None: ...

class TokenizeResult(_message.Message):
    __slots__ = ("token_ids", "pieces", "count", "offsets")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    count: int
    offsets: TokenOffsets
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[bytes]] = ..., count: _Optional[int] = ..., offsets: _Optional[_Union[TokenOffsets, _Mapping]] = ...) -> None: ...

class TokenOffsets(_message.Message):
    __slots__ = ("byte_starts", "byte_ends", "char_starts", "char_ends")
    BYTE_STARTS_FIELD_NUMBER: _ClassVar[int]
    BYTE_ENDS_FIELD_NUMBER: _ClassVar[int]
    CHAR_STARTS_FIELD_NUMBER: _ClassVar[int]
    CHAR_ENDS_FIELD_NUMBER: _ClassVar[int]
    byte_starts: _containers.RepeatedScalarFieldContainer[int]
    byte_ends: _containers.RepeatedScalarFieldContainer[int]
    char_starts: _containers.RepeatedScalarFieldContainer[int]
    char_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, byte_starts: _Optional[_Iterable[int]] = ..., byte_ends: _Optional[_Iterable[int]] = ..., char_starts: _Optional[_Iterable[int]] = ..., char_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled", "not_found")
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    cancelled: _containers.RepeatedScalarFieldContainer[str]
    not_found: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cancelled: _Optional[_Iterable[str]] = ..., not_found: _Optional[_Iterable[str]] = ...) -> None: ...

class GetServerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerStatusResponse(_message.Message):
    __slots__ = ("running_sequences", "queued_requests", "paused_sequences", "cache_tokens_used", "cache_tokens_free", "max_batch_size", "max_queued_requests", "engine_steps", "cancelled_total", "last_cancel_latency_steps", "last_cancel_latency_ms", "max_cancel_latency_steps", "rejected_total", "draining", "started_total", "cached_prefixes", "cached_prefix_tokens", "prompt_tokens_total", "cached_prompt_tokens_total", "prefix_cache_hit_rate", "preempted_total", "preempted_sequences", "recomputed_tokens_total", "callers", "draft_tokens_total", "accepted_draft_tokens_total", "attention_provider", "cache_block_size", "cache_events_sequence", "retiled_tokens_total", "engine_restarts", "prefix_reuse")
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FREE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_CANCEL_LATENCY_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_CANCEL_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_CANCEL_LATENCY_STEPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STARTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CALLERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RETILED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    running_sequences: int
    queued_requests: int
    paused_sequences: int
    cache_tokens_used: int
    cache_tokens_free: int
    max_batch_size: int
    max_queued_requests: int
    engine_steps: int
    cancelled_total: int
    last_cancel_latency_steps: int
    last_cancel_latency_ms: float
    max_cancel_latency_steps: int
    rejected_total: int
    draining: bool
    started_total: int
    cached_prefixes: int
    cached_prefix_tokens: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    prefix_cache_hit_rate: float
    preempted_total: int
    preempted_sequences: int
    recomputed_tokens_total: int
    callers: _containers.RepeatedCompositeFieldContainer[CallerStatus]
    draft_tokens_total: int
    accepted_draft_tokens_total: int
    attention_provider: str
    cache_block_size: int
    cache_events_sequence: int
    retiled_tokens_total: int
    engine_restarts: int
    prefix_reuse: PrefixReuse
    def __init__(self, running_sequences: _Optional[int] = ..., queued_requests: _Optional[int] = ..., paused_sequences: _Optional[int] = ..., cache_tokens_used: _Optional[int] = ..., cache_tokens_free: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., engine_steps: _Optional[int] = ..., cancelled_total: _Optional[int] = ..., last_cancel_latency_steps: _Optional[int] = ..., last_cancel_latency_ms: _Optional[float] = ..., max_cancel_latency_steps: _Optional[int] = ..., rejected_total: _Optional[int] = ..., draining: _Optional[bool] = ..., started_total: _Optional[int] = ..., cached_prefixes: _Optional[int] = ..., cached_prefix_tokens: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_prompt_tokens_total: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., preempted_total: _Optional[int] = ..., preempted_sequences: _Optional[int] = ..., recomputed_tokens_total: _Optional[int] = ..., callers: _Optional[_Iterable[_Union[CallerStatus, _Mapping]]] = ..., draft_tokens_total: _Optional[int] = ..., accepted_draft_tokens_total: _Optional[int] = ..., attention_provider: _Optional[str] = ..., cache_block_size: _Optional[int] = ..., cache_events_sequence: _Optional[int] = ..., retiled_tokens_total: _Optional[int] = ..., engine_restarts: _Optional[int] = ..., prefix_reuse: _Optional[_Union[PrefixReuse, str]] = ...) -> None: ...

class CallerStatus(_message.Message):
    __slots__ = ("caller", "running_sequences", "queued_requests", "preempted_sequences", "prompt_tokens_total", "generated_tokens_total", "preempted_total", "refused_total", "shed_total", "queue_timeouts_total", "weight")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    caller: str
    running_sequences: int
    queued_requests: int
    preempted_sequences: int
    prompt_tokens_total: int
    generated_tokens_total: int
    preempted_total: int
    refused_total: int
    shed_total: int
    queue_timeouts_total: int
    weight: float
    def __init__(self, caller: _Optional[str] = ..., running_sequences: _Optional[int] = ..., queued_requests: _Optional[int] = ..., preempted_sequences: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., preempted_total: _Optional[int] = ..., refused_total: _Optional[int] = ..., shed_total: _Optional[int] = ..., queue_timeouts_total: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "engine", "context_length", "vocab_size", "special_tokens", "samplers", "constraint_kinds", "limits", "has_chat_template", "quantization", "speculation_modes", "default_speculation", "request_features", "attention_provider", "cache_block_size", "cache_event_sources", "tool_call_format", "template_renders_tools", "reasoning_format", "reuses_decoded_cells", "prefix_reuse")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_KINDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MODES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FEATURES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENT_SOURCES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_RENDERS_TOOLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    REUSES_DECODED_CELLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    engine: str
    context_length: int
    vocab_size: int
    special_tokens: SpecialTokens
    samplers: _containers.RepeatedScalarFieldContainer[str]
    constraint_kinds: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    has_chat_template: bool
    quantization: str
    speculation_modes: _containers.RepeatedScalarFieldContainer[SpeculationMode]
    default_speculation: Speculation
    request_features: _containers.RepeatedScalarFieldContainer[str]
    attention_provider: str
    cache_block_size: int
    cache_event_sources: CacheEventSources
    tool_call_format: str
    template_renders_tools: bool
    reasoning_format: str
    reuses_decoded_cells: bool
    prefix_reuse: PrefixReuse
    def __init__(self, model_id: _Optional[str] = ..., engine: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., special_tokens: _Optional[_Union[SpecialTokens, _Mapping]] = ..., samplers: _Optional[_Iterable[str]] = ..., constraint_kinds: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., has_chat_template: _Optional[bool] = ..., quantization: _Optional[str] = ..., speculation_modes: _Optional[_Iterable[_Union[SpeculationMode, str]]] = ..., default_speculation: _Optional[_Union[Speculation, _Mapping]] = ..., request_features: _Optional[_Iterable[str]] = ..., attention_provider: _Optional[str] = ..., cache_block_size: _Optional[int] = ..., cache_event_sources: _Optional[_Union[CacheEventSources, _Mapping]] = ..., tool_call_format: _Optional[str] = ..., template_renders_tools: _Optional[bool] = ..., reasoning_format: _Optional[str] = ..., reuses_decoded_cells: _Optional[bool] = ..., prefix_reuse: _Optional[_Union[PrefixReuse, str]] = ...) -> None: ...

class CacheEventSources(_message.Message):
    __slots__ = ("endpoint", "replay_endpoint", "topic")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    replay_endpoint: str
    topic: str
    def __init__(self, endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., topic: _Optional[str] = ...) -> None: ...

class WatchCacheEventsRequest(_message.Message):
    __slots__ = ("snapshot", "start_sequence")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    start_sequence: int
    def __init__(self, snapshot: _Optional[bool] = ..., start_sequence: _Optional[int] = ...) -> None: ...

class WatchCacheEventsResponse(_message.Message):
    __slots__ = ("sequence", "timestamp", "events", "snapshot")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    snapshot: bool
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialTokens(_message.Message):
    __slots__ = ("bos_token_id", "eos_token_ids", "pad_token_id")
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    def __init__(self, bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_batch_size", "max_new_tokens", "max_stop_sequences", "max_stop_sequence_length", "max_top_logprobs", "max_logit_bias_entries", "max_samples", "max_tokenize_texts")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENIZE_TEXTS_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    max_new_tokens: int
    max_stop_sequences: int
    max_stop_sequence_length: int
    max_top_logprobs: int
    max_logit_bias_entries: int
    max_samples: int
    max_tokenize_texts: int
    def __init__(self, max_batch_size: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., max_stop_sequence_length: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_logit_bias_entries: _Optional[int] = ..., max_samples: _Optional[int] = ..., max_tokenize_texts: _Optional[int] = ...) -> None: ...
