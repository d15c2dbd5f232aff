"""The engine's settings, declared once: the server's config nests an EngineConfig, and each engine
reads the shared part and its own section. Every rule between settings is checked when the object is
built, so a bad combination fails in one line naming the setting, however it was built."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from backend.constraints import ConstraintLimits
from backend.types import SpeculationMode


class EngineKind(enum.StrEnum):
    LLAMA_CPP = "llama.cpp"
    """GGUF models on CPU or GPU."""
    EXLLAMAV2 = "exllamav2"
    """EXL2, GPTQ or FP16 model directories on CUDA GPUs."""
    EXLLAMAV3 = "exllamav3"
    """EXL3, FP16 or BF16 model directories on CUDA GPUs."""


class SpeculationSetting(enum.StrEnum):
    """The server's speculative decoding, for requests that do not choose (see Speculation in the proto)."""

    AUTO = "auto"
    """llama.cpp: n-gram, its planner checking proposals only in steps where that pays. exllamav2 and
    exllamav3: off (their generators draft for every job every step, which their own docs call detrimental
    at larger batches; not measured on a GPU here), or the draft model when one is set."""
    OFF = "off"
    NGRAM = "ngram"


class CacheType(enum.StrEnum):
    """exllamav2's cache precision: a quantized cache holds more tokens in the same memory."""

    FP16 = "fp16"
    Q8 = "q8"
    Q6 = "q6"
    Q4 = "q4"


class AttentionSetting(enum.StrEnum):
    """exllamav2's attention. Paged attention (continuous batching, shared prefix pages) needs a
    flash_attn with block tables; without one exllamav2 runs one request at a time."""

    AUTO = "auto"
    """flash-attn when a paged one imports, else sdpa."""
    FLASH_ATTN = "flash-attn"
    """flash-attn >= 2.5.7 or the engine does not start."""
    SDPA = "sdpa"
    """tokenspout's own paged attention on torch's scaled_dot_product_attention
    (backend.exllamav2.paged_attention), whatever else is installed."""
    OFF = "off"
    """No paged attention: exllamav2's own unpaged path, one request at a time."""


MAX_DRAFT_TOKENS = 64
"""The most proposed tokens a request or the server may ask to check in one step."""


def _require(rules: list[tuple[bool, str]]) -> None:
    for broken, message in rules:
        if broken:
            raise ValueError(message)


class SchedulingPolicy(enum.StrEnum):
    FAIR = "fair"
    """Callers share the engine by weighted token counts; priority first; time-slicing (backend.common.fairness)."""
    FIFO = "fifo"
    """First come, first served, whoever the caller (the baseline bench/fairness.py measures against)."""


@dataclass(frozen=True)
class FairnessSettings:
    scheduling: SchedulingPolicy = SchedulingPolicy.FAIR
    time_slice_steps: int = 16
    """Steps a sequence runs at least before it may be preempted for another caller's share."""
    max_running_per_caller: int = 0
    """Sequences one caller may have in the batch at once (0: max_batch_size)."""

    def __post_init__(self) -> None:
        _require([
            (self.time_slice_steps < 1, "time_slice_steps must be at least 1"),
            (self.max_running_per_caller < 0, "max_running_per_caller must not be negative"),
        ])

    @property
    def fair(self) -> bool:
        return self.scheduling is SchedulingPolicy.FAIR


@dataclass(frozen=True)
class LlamaCppSettings:
    threads: int = 0
    """CPU threads for llama.cpp; 0: the engine picks every core or every core but one, whichever
    decodes faster as the machine's load changes (see backend.llamacpp.speculation.threads)."""
    batch_tokens: int = 512
    """Most tokens in one llama_decode call: bounds a prefill chunk, and so how long decoding waits for it."""
    gpu_layers: int = 0
    """Layers to offload to a GPU (a CUDA or Metal build of llama.cpp)."""
    prefix_cache: bool = True
    """Start each prompt from the longest cached prefix of earlier ones (greedy output is unchanged)."""
    prefix_cache_slots: int = 2
    """Cache streams beyond max_batch_size that only keep prefixes (context_length cells each)."""
    prefix_cache_generated: bool = True
    """Keep what a sequence generated cached too, computed again as prompt rows once it ends (so greedy
    output is still unchanged): a chat's next turn reuses the previous answer (backend.llamacpp.retile)."""
    prefix_cache_decoded: bool = False
    """Let a chat's next turn take the cells its previous answer was decoded in as they are, as llama-server
    does, instead of computing that answer again: the next turn computes only its new message at once, but
    its greedy output may part from a cold run's at near ties (llama.cpp rounds a token decoded alone
    otherwise than one in a prompt group). Prompts that continue no answer keep the guarantee."""
    max_pause_s: float = 300.0
    """A sequence whose caller reads nothing for this long ends with ABORTED (PAUSED_TOO_LONG)."""
    first_token_hold_ms: float = 2.0
    """After a step that gave a request its first token, how long the next step waits so that the threads
    sending it (the service's, a sidecar's, a caller's on the same cores) run before llama.cpp's threads take
    the cores again; not while another request waits for its own first token. 0: no wait."""

    def __post_init__(self) -> None:
        _require([
            (self.threads < 0, "threads must not be negative"),
            (not 0 <= self.first_token_hold_ms <= 100, "first_token_hold_ms must be in [0, 100]"),
            (self.gpu_layers < 0, "gpu_layers must not be negative"),
            (self.prefix_cache_slots < 0, "prefix_cache_slots must not be negative"),
            (self.max_pause_s <= 0, "max_pause_s must be positive"),
        ])



@dataclass(frozen=True)
class ExLlamaV2Settings:
    cache_tokens: int = 0
    """The cache's token budget shared by all jobs (0: context_length * max_batch_size)."""
    cache_type: CacheType = CacheType.FP16
    gpu_split: tuple[float, ...] = ()
    """GB per GPU (empty: fill the GPUs in order)."""
    draft_model: str = ""
    """An EXL2 model directory with the same vocabulary, whose proposals the model checks (speculative decoding)."""
    attention: AttentionSetting = AttentionSetting.AUTO
    """Which paged attention exllamav2 runs on (backend.exllamav2.attention_provider)."""

    def __post_init__(self) -> None:
        _require([
            (self.cache_tokens < 0, "cache_tokens must not be negative"),
            (any(gb <= 0 for gb in self.gpu_split), "gpu_split: every GPU's share must be positive"),
        ])


class TensorParallelBackend(enum.StrEnum):
    """How exllamav3's tensor-parallel processes exchange activations."""

    NATIVE = "native"
    NCCL = "nccl"


@dataclass(frozen=True)
class ExLlamaV3Settings:
    cache_tokens: int = 0
    """The cache's token budget shared by all jobs (0: context_length * max_batch_size)."""
    cache_bits: int = 0
    """Bits per key in the cache: 0 for FP16, 2 to 8 to quantize it (more tokens in the same memory)."""
    cache_v_bits: int = 0
    """Bits per value, where they differ from the keys' (0: cache_bits)."""
    gpu_split: tuple[float, ...] = ()
    """GB to use per GPU (empty: fill the GPUs in order)."""
    tensor_parallel: bool = False
    """Split each layer across the GPUs (one process per GPU beyond the first) instead of layers across them."""
    tensor_parallel_backend: TensorParallelBackend = TensorParallelBackend.NATIVE
    draft_model: str = ""
    """An EXL3 model directory with the same vocabulary, whose proposals the model checks (speculative decoding)."""
    ngram_match_min: int = 2
    """With speculation = ngram: the fewest tokens of the output that must match earlier text to draft what
    followed it (TabbyAPI's default)."""

    def __post_init__(self) -> None:
        _require([
            (self.cache_tokens < 0, "exllamav3_cache_tokens must not be negative"),
            (self.cache_bits != 0 and not 2 <= self.cache_bits <= 8, "exllamav3_cache_bits must be 0 (FP16) or 2 to 8"),
            (self.cache_v_bits != 0 and not 2 <= self.cache_v_bits <= 8, "exllamav3_cache_v_bits must be 0 or 2 to 8"),
            (self.cache_v_bits != 0 and self.cache_bits == 0,
             "exllamav3_cache_v_bits needs exllamav3_cache_bits: an FP16 cache has no bits to set"),
            (any(gb <= 0 for gb in self.gpu_split), "exllamav3_gpu_split: every GPU's share must be positive"),
            (self.ngram_match_min < 1, "exllamav3_ngram_match_min must be at least 1"),
        ])


_SECTIONS = {"llamacpp": LlamaCppSettings, "exllamav2": ExLlamaV2Settings, "exllamav3": ExLlamaV3Settings,
             "fairness": FairnessSettings}


@dataclass(frozen=True)
class EngineConfig:
    kind: EngineKind = field(default=EngineKind.LLAMA_CPP, metadata={"setting": "engine"})
    model: str = "default"
    """A local GGUF path (or "default": the embedded SmolLM2-135M-Instruct), or a model directory for exllamav2 or exllamav3."""
    model_id: str = ""
    """The name callers use in `model`; defaults to the model's own name."""
    context_length: int = 2048
    """Most tokens one sequence holds, prompt and output together."""
    max_batch_size: int = 8
    """Sequences decoded together."""
    speculation: SpeculationSetting = SpeculationSetting.AUTO
    """What a request that does not choose gets; the output is the same either way."""
    max_draft_tokens: int = 16
    """Most proposed tokens checked in one step, for a request that does not say."""
    max_queued_requests: int = 16
    """Requests that may wait beyond max_batch_size; more are refused with RESOURCE_EXHAUSTED."""
    max_queued_per_caller: int = 0
    """Requests one caller may have waiting beyond max_running_per_caller (0: max_queued_requests)."""
    fairness: FairnessSettings = field(default_factory=FairnessSettings)
    llamacpp: LlamaCppSettings = field(default_factory=LlamaCppSettings)
    exllamav2: ExLlamaV2Settings = field(default_factory=ExLlamaV2Settings)
    exllamav3: ExLlamaV3Settings = field(default_factory=ExLlamaV3Settings, metadata={"prefix": "exllamav3_"})
    constraint: ConstraintLimits = field(default_factory=ConstraintLimits, metadata={"prefix": "constraint_"})
    compile_threads: int = 1
    """Threads for large constraint compiles (small ones have a thread of their own), apart from everything else."""
    max_concurrent_compiles: int = 4
    """Large constraint compiles running at once; more are refused with RESOURCE_EXHAUSTED and RetryInfo."""
    cache_events: bool = False
    """Track which prompt prefixes the cache holds, as KV-cache events for routers (WatchCacheEvents,
    and ZMQ with cache_events_endpoint). llama.cpp only."""
    cache_events_replay_batches: int = 10_000
    """Event batches kept for a subscriber that asks to catch up; an older start gets a snapshot."""

    def __post_init__(self) -> None:
        _require([
            (self.cache_events and self.kind is not EngineKind.LLAMA_CPP,
             f"cache_events: the {self.kind} engine publishes no cache events (llama.cpp only, see docs/engines.md)"),
            (self.cache_events and not self.llamacpp.prefix_cache,
             "cache_events needs prefix_cache: without it no cached cells are reused, so there is nothing to publish"),
            (self.cache_events_replay_batches < 1, "cache_events_replay_batches must be at least 1"),
            (self.context_length < 16, "context_length must be at least 16"),
            (self.max_batch_size < 1, "max_batch_size must be at least 1"),
            (min(self.compile_threads, self.max_concurrent_compiles) < 1,
             "compile_threads and max_concurrent_compiles must be positive"),
            (self.max_queued_requests < 0 or self.max_queued_per_caller < 0,
             "max_queued_requests and max_queued_per_caller must not be negative"),
            (self.llamacpp.batch_tokens < self.max_batch_size, "batch_tokens must be at least max_batch_size"),
            (not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS, f"max_draft_tokens must be 1 to {MAX_DRAFT_TOKENS}"),
            (bool(self.exllamav2.draft_model) and self.speculation is SpeculationSetting.NGRAM,
             "draft_model and speculation = ngram exclude each other (exllamav2 drafts one way)"),
            (bool(self.exllamav3.draft_model) and self.speculation is SpeculationSetting.NGRAM,
             "exllamav3_draft_model and speculation = ngram exclude each other (exllamav3 drafts one way)"),
        ])

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most: a batch place or a queue place each."""
        return self.max_batch_size + self.max_queued_requests

    @property
    def max_running_per_caller(self) -> int:
        return self.fairness.max_running_per_caller or self.max_batch_size

    @property
    def per_caller_limit(self) -> int:
        """Requests one caller may hold, running or queued."""
        return self.max_running_per_caller + (self.max_queued_per_caller or self.max_queued_requests)

    def speculation_mode(self, auto: SpeculationMode) -> SpeculationMode:
        """The server's mode, `auto` standing for the engine's own choice."""
        return auto if self.speculation is SpeculationSetting.AUTO else SpeculationMode(self.speculation.value)

    @classmethod
    def of(cls, **settings: Any) -> EngineConfig:
        """Built from setting names alone (`context_length=1024, prefix_cache=False`), each going to its
        section, as tests and benchmarks like to write it; a name two engines' sections share (cache_tokens,
        draft_model) goes to the section of the engine `kind` names."""
        engine = str(settings.get("kind", EngineKind.LLAMA_CPP))
        sections = {}
        for section, kind in sorted(_SECTIONS.items(), key=lambda item: item[0] != engine):
            names = {f.name for f in dataclasses.fields(kind)} & settings.keys()
            sections[section] = kind(**{name: settings.pop(name) for name in names})
        return cls(**settings, **sections)
