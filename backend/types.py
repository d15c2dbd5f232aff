"""Neutral request types shared by every engine and the service, and what an engine says about its model.

Nothing here knows about gRPC or about a particular engine: the service turns
protobuf into these. What comes back, token by token, is in backend.events.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from backend.constraints import ConstraintSpec
from backend.tools import ToolCall

DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")
SAMPLE_SEPARATOR = "\u00b7"
"""Between a request's id and a sample's index in the engine's id for that sample: not printable ASCII, so
no caller's request id can be one."""


@dataclass(frozen=True)
class DryParams:
    multiplier: float = 0.0
    """0 is off."""
    base: float = 1.75
    allowed_length: int = 2
    last_n: int = 0
    """0 means the whole context."""
    sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS


@dataclass(frozen=True)
class XtcParams:
    probability: float = 0.0
    """0 is off."""
    threshold: float = 0.1


@dataclass(frozen=True)
class MirostatParams:
    """Mirostat 2.0; it replaces the plain random draw."""

    tau: float = 5.0
    eta: float = 0.1


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings with every default made explicit (temperature 0 = greedy).

    Field names are the contract's, so an engine lists the ones it honours by name.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    dry: DryParams = DryParams()
    xtc: XtcParams = XtcParams()
    mirostat: MirostatParams | None = None
    top_a: float = 0.0
    tfs: float = 1.0
    skew: float = 0.0
    smoothing_factor: float = 0.0
    banned_strings: tuple[str, ...] = ()
    token_healing: bool = False

    @staticmethod
    def greedy_at(temperature: float) -> bool:
        """Temperature 0 always takes the most likely token: the one spelling of greedy."""
        return temperature == 0.0

    @property
    def greedy(self) -> bool:
        return self.greedy_at(self.temperature)

    @property
    def penalized(self) -> bool:
        return self.penalty_last_n > 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def dry_on(self) -> bool:
        return self.dry.multiplier > 0.0

    def in_effect(self) -> set[str]:
        """The samplers this request turns on, by field name: the ones an engine must honour."""
        defaults = SamplingParams()
        names = {name for name in self.__dataclass_fields__ if getattr(self, name) != getattr(defaults, name)}
        if not self.dry_on:
            names.discard("dry")
        if self.xtc.probability == 0.0:
            names.discard("xtc")
        return names - {"seed"}


@dataclass(frozen=True)
class StopParams:
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_sequence: bool = False
    ignore_eos: bool = False
    time_limit_s: float | None = None


@dataclass(frozen=True)
class OutputParams:
    return_tokens: bool = False
    return_logprobs: bool = False
    top_logprobs: int = 0


class SpeculationMode(enum.StrEnum):
    """Where proposed tokens come from (see backend.llamacpp.speculation); the output is the same either way."""

    OFF = "off"
    NGRAM = "ngram"
    """Continue the longest recent n-gram of the prompt and output that occurred before."""
    DRAFT_MODEL = "draft_model"
    """A second, smaller model proposes (exllamav2 with a draft_model)."""


@dataclass(frozen=True)
class SpeculationParams:
    mode: SpeculationMode = SpeculationMode.OFF
    max_draft_tokens: int = 16
    """Most proposed tokens checked in one step."""


@dataclass(frozen=True)
class Scheduling:
    """Who a request is for and how urgent it is, as the service decided (see backend.common.fairness)."""

    caller: str = ""
    """The fairness key: requests with the same key share one caller's share of the engine."""
    weight: float = 1.0
    """The caller's share relative to others (2.0: twice the tokens of a caller of weight 1)."""
    priority: int = 0
    """Higher is more urgent; negative is sheddable (refused, shed and preempted first)."""
    queue_timeout_s: float | None = None
    """A request not started this long after arrival ends with QUEUE_TIMEOUT."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: the engine may assume every field is in range."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stopping: StopParams = StopParams()
    output: OutputParams = OutputParams()
    constraint: ConstraintSpec | None = None
    """What the output must match; the engine compiles it (a cache hit: the service has it compiled first)."""
    constraint_compile_s: float = 0.0
    """What compiling the constraint cost this request (0 when it came from the cache), for its timings."""
    speculation: SpeculationParams = SpeculationParams()
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    """The caller's deadline (time.monotonic()); a request still queued then never starts."""
    last_message_start: int = 0
    """Where a chat's last message begins in prompt_token_ids (0: not known): what later requests
    of the same conversation or app most likely share; an engine may keep it reusable."""
    scheduling: Scheduling = Scheduling()
    truncated_tokens: int = 0
    """Prompt tokens the caller's truncate_input_tokens dropped before prompt_token_ids."""
    sample_seeds: tuple[int, ...] = ()
    """With more than one: that many samples of the prompt, each with its seed (see `samples`)."""
    sample_index: int = 0
    """Which of its request's samples this is (see `samples`)."""
    prompt_logprobs: int = -1
    """-1: none; else return each prompt token's logprob with this many top alternatives."""
    turn_end: tuple[int, ...] = ()
    """For a chat: the tokens its template writes after an answer, up to where the next message begins;
    an engine that keeps generated tokens cached may keep these after them for the next turn."""
    cache_salt: str = ""
    """Cached prefixes are shared only between requests of the same salt ("": unsalted). The service's
    value: the caller's cache_salt mixed with the server's cache scope (see service.cache_scope)."""

    @property
    def n(self) -> int:
        return max(1, len(self.sample_seeds))

    @property
    def group(self) -> str:
        """The id of the request it is a sample of (its own, unless it is one of several samples: see `samples`);
        one cancel of that id reaches every sample."""
        return self.request_id.rpartition(SAMPLE_SEPARATOR)[0] if self.sample_index else self.request_id

    def samples(self) -> list[GenerationRequest]:
        """One request per sample: the first keeps the request's id, sample i is "<id>·i"; each has its
        own seed and asks for one sample."""
        if self.n == 1:
            return [self]
        return [
            dataclasses.replace(
                self, request_id=self.request_id if i == 0 else f"{self.request_id}{SAMPLE_SEPARATOR}{i}",
                sample_index=i,
                sampling=dataclasses.replace(self.sampling, seed=seed), sample_seeds=(),
                prompt_logprobs=self.prompt_logprobs if i == 0 else -1,
            )
            for i, seed in enumerate(self.sample_seeds)
        ]

    @property
    def queue_deadline(self) -> float | None:
        """When a request still waiting to start gives up (queue_timeout_s after arrival)."""
        timeout = self.scheduling.queue_timeout_s
        return None if timeout is None else self.arrival_time + timeout

    @property
    def end_by(self) -> float | None:
        """When the request must end: the caller's deadline or its own time limit, whichever comes first."""
        limits = [self.deadline]
        if self.stopping.time_limit_s is not None:
            limits.append(self.arrival_time + self.stopping.time_limit_s)
        return min((t for t in limits if t is not None), default=None)

    @property
    def ends_at_deadline(self) -> bool:
        """The caller's deadline, not the request's own time limit, is what `end_by` names."""
        return self.deadline is not None and self.end_by == self.deadline


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant's calls in this turn."""
    tool_call_id: str = ""
    """A "tool" message: the call it answers."""
    reasoning: str = ""
    """An assistant's reasoning, for templates that render it (as reasoning_content)."""


@dataclass(frozen=True)
class ChatContext:
    """What a chat template is given besides the messages (Hugging Face's names)."""

    tools: tuple[dict[str, object], ...] | None = None
    """Function tools as templates take them: {"type": "function", "function": {name, description, parameters}}."""
    enable_thinking: bool | None = None
    """None: the template's default."""


class PrefixReuse(enum.StrEnum):
    """How an engine reuses cached prefixes, and so whether greedy output may depend on what was cached."""

    OFF = "off"
    AS_CACHED = "as_cached"
    """Cells taken as they were computed (decoded ones included), as llama-server, vLLM and SGLang take them:
    greedy output may part from a cold run's at a near tie."""
    EXACT = "exact"
    """Only cells a cold run computes the same way (llama.cpp's prefix_cache_exact): greedy output is a cold run's."""


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    engine: str
    context_length: int
    vocab_size: int
    max_batch_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    samplers: tuple[str, ...]
    constraint_kinds: tuple[str, ...] = field(default_factory=tuple)
    quantization: str = ""
    speculation_modes: tuple[SpeculationMode, ...] = (SpeculationMode.OFF,)
    """The modes a request may ask for."""
    default_speculation: SpeculationParams = SpeculationParams()
    draft_tokens_per_request: bool = True
    """Whether a request's own max_draft_tokens is honoured (the exllama generators draft the same for every job)."""
    request_features: tuple[str, ...] = ("prompt_token_ids", "truncate_input_tokens")
    """The request options it serves, by field name (the service does these two for every engine; "n" and
    "output.prompt_logprobs" are an engine's own)."""
    template_tool_format: str = ""
    """The tool-call format its chat template renders (backend.tools.detect_format), "" when it renders no tools."""
    template_reasoning_format: str = ""
    """The reasoning markup its chat template knows ("think"), or ""."""
    cache_block_size: int = 0
    """Tokens per block of its KV-cache events (0: it publishes none)."""
    attention_provider: str = ""
    """The attention it runs on: "llama.cpp"; for exllamav2 "flash-attn", "sdpa" or "triton" (tokenspout's
    paged attention) or "none" (unpaged); "exllamav3" for exllamav3 (its own paged Triton kernels); "" where it
    means nothing (a test's fake engine)."""
    reuses_decoded_cells: bool = False
    """Whether a next turn reuses its answer's cells as decoding computed them."""
    prefix_reuse: PrefixReuse = PrefixReuse.OFF
    """How it reuses cached prefixes (GetModelInfo.prefix_reuse)."""
    cache_tokens: int = 0
    """Where every request's prompt + max_new_tokens is reserved up front in whole pages of `cache_page_tokens`
    (the exllama generators), the cache's size: a request that can never fit is refused before it is queued.
    0: no such reservation (a llama.cpp sequence owns context_length cells and ends at CONTEXT_LIMIT)."""
    cache_page_tokens: int = 0
    cache_reserve_tokens: int = 0
    """Tokens a job reserves in the cache beyond prompt + max_new_tokens (exllamav3: one, and its drafts' window)."""

    def budget_problem(self, prompt_tokens: int, max_new_tokens: int) -> str:
        """Why a request of this size can never run here, or "" (checked before it is submitted)."""
        if not self.cache_tokens:
            return ""
        total, page = prompt_tokens + max_new_tokens, self.cache_page_tokens
        if total > self.context_length:
            return f"prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) exceeds the {self.context_length}-token context"
        pages = -(-(total + self.cache_reserve_tokens) // page)
        if pages > self.cache_tokens // page:
            return f"prompt + max_new_tokens needs {pages} cache pages; the cache has {self.cache_tokens // page}"
        return ""


ALL_REQUEST_FEATURES = ("prompt_token_ids", "n", "truncate_input_tokens", "output.prompt_logprobs", "cache_salt")

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")

COMMON_SAMPLERS = (
    "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "penalty_last_n", "seed", "logit_bias", "dry", "xtc", "mirostat",
)
"""SamplingParams fields every engine honours (GetModelInfo.samplers lists an engine's own)."""
