"""The engine's settings, declared once: the server's config nests an EngineConfig, and each engine
reads the shared part and its own section. Every rule between settings is checked when the object is
built, so a bad combination fails in one line naming the setting, however it was built."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from backend.constraints import ConstraintLimits
from backend.setting import Group, setting
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
    TRITON = "triton"
    """tokenspout's own paged attention as a Triton kernel that reads each page once through the block
    table (backend.exllamav2.paged_attention_triton); needs triton, which CUDA builds of torch bring."""
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
    """First come, first served, whoever the caller (the baseline bench/suite/fairness.py measures against)."""


@dataclass(frozen=True)
class FairnessSettings:
    scheduling: SchedulingPolicy = setting(
        SchedulingPolicy.FAIR,
        "`fair`: callers share the server by weighted token counts, priority first. `fifo`: first come, first "
        "served; then only `priority` 0 is accepted.", Group.SCHEDULING)
    time_slice_steps: int = setting(
        16, "Engine steps a sequence runs at least before it may give its slot to another caller. A more urgent "
        "request does not wait.", Group.SCHEDULING, values="at least 1")
    max_running_per_caller: int = setting(
        0, "One caller's sequences in the batch. `0`: `max_batch_size`.", Group.SCHEDULING, values="0 or more")

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
    # threads = 0: backend.llamacpp.speculation.threads picks the count as the machine's load changes.
    threads: int = setting(
        0, "CPU threads. `0` adapts: the engine runs every core or every core but one, whichever costs less per "
        "row as the machine's load changes (the cores its affinity and a container's CPU quota allow). A number "
        "fixes the count.", Group.LLAMA_CPP, values="0 or more")
    batch_tokens: int = setting(
        512, "Most prompt tokens in one decode call. It bounds a prefill chunk, and so how long decoding streams "
        "wait for it.", Group.LLAMA_CPP, values="at least `max_batch_size`")
    gpu_layers: int = setting(
        0, "Layers offloaded to a GPU (needs a CUDA or Metal build of llama.cpp).", Group.LLAMA_CPP,
        values="0 or more")
    prefix_cache: bool = setting(
        True, "Start each prompt from the longest cached prefix of earlier prompts and answers, to the token, and "
        "compute only the rest ([engines](engines.md#prefix-cache-and-prompt-layout)).", Group.LLAMA_CPP)
    prefix_cache_slots: int = setting(
        2, "Cache streams beyond `max_batch_size` that only keep prefixes, `context_length` cells each.",
        Group.LLAMA_CPP, values="0 or more")
    prefix_cache_generated: bool = setting(
        True, "Keep what a sequence generated cached too, so a chat's next turn computes only its new message: the "
        "answer's cells as decoded, or with `prefix_cache_exact` computed again as prompt rows while the engine is "
        "idle or when the next turn arrives ([engines](engines.md#prefix-cache-and-prompt-layout)).",
        Group.LLAMA_CPP)
    # llama.cpp rounds a row otherwise in another group (a token decoded alone, a tile cut short): near ties part.
    prefix_cache_exact: bool = setting(
        False, "Greedy output equal to a cold run's whatever was cached: reuse only cells computed as a cold prompt "
        "computes them (whole 64-token tiles; answers computed again as prompt rows; prefixes under 16 tokens "
        "computed again). Off, cells are reused to the token as they were computed, as llama-server, vLLM and "
        "SGLang reuse them, and output may part from a cold run's where two tokens nearly tie. Replaces "
        "`prefix_cache_decoded` (now the default behaviour). Reported as `prefix_reuse` in `GetModelInfo` and "
        "`GetServerStatus` ([engines](engines.md#prefix-cache-and-prompt-layout)).", Group.LLAMA_CPP)
    max_pause_s: float = setting(
        300.0, "A stream whose caller reads nothing this long ends with `ABORTED` (`PAUSED_TOO_LONG`).",
        Group.LLAMA_CPP, values="seconds, above 0")
    first_token_hold_ms: float = setting(
        2.0, "After a step that gave a request its first token, the next step waits this long, so that the "
        "threads sending it (the service's, a sidecar's, a caller's on the same cores) run before llama.cpp's "
        "threads take the cores again; not while another request waits for its own first token. `0`: no wait "
        "([benchmarks](benchmarks.md#time-to-first-token-and-decode-against-llama-server)).", Group.LLAMA_CPP,
        values="0 to 100")

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
    cache_tokens: int = setting(
        0, "Cache budget shared by all jobs, in tokens (rounded up to 256-token pages). `0`: `context_length` x "
        "`max_batch_size`.", Group.EXLLAMAV2, values="0 or more")
    cache_type: CacheType = setting(
        CacheType.FP16, "Cache precision. A quantized cache holds more tokens in the same memory.",
        Group.EXLLAMAV2)
    gpu_split: tuple[float, ...] = setting(
        (), "GB per GPU, comma-separated (`20,24`).", Group.EXLLAMAV2, values="positive numbers, comma-separated",
        shown_default="all GPUs in order")
    draft_model: str = setting(
        "", "An EXL2 directory with the same vocabulary, whose proposals the model checks. Excludes "
        "`speculation = ngram`.", Group.EXLLAMAV2, values="a directory")
    # backend.exllamav2.attention_provider picks and reports the provider.
    attention: AttentionSetting = setting(
        AttentionSetting.AUTO, "Which paged attention exllamav2 runs on: `auto` (flash-attn when a paged one "
        "imports, else `sdpa`), `flash-attn` (flash-attn >= 2.5.7 or no start), `sdpa` (tokenspout's own paged "
        "attention on torch's `scaled_dot_product_attention`), `triton` (tokenspout's own paged attention as a "
        "Triton kernel that reads each page once through the block table; needs `triton`, which CUDA builds of "
        "torch install), `off` (unpaged: one request at a time). `GetModelInfo.attention_provider` says which "
        "runs.", Group.EXLLAMAV2)

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
    cache_tokens: int = setting(
        0, "Cache budget shared by all jobs, in tokens (rounded up to 256-token pages). `0`: `context_length` x "
        "`max_batch_size`.", Group.EXLLAMAV3, values="0 or more")
    cache_bits: int = setting(
        0, "`0`: an FP16 cache. `2` to `8`: keys (and values) quantized to that many bits; more tokens in the same "
        "memory.", Group.EXLLAMAV3, values="0, or 2 to 8")
    cache_v_bits: int = setting(
        0, "Bits for the values where they differ from the keys' (`0`: `exllamav3_cache_bits`). Needs "
        "`exllamav3_cache_bits`.", Group.EXLLAMAV3, values="0, or 2 to 8")
    gpu_split: tuple[float, ...] = setting(
        (), "GB to use per GPU, comma-separated (`20,24`).", Group.EXLLAMAV3,
        values="positive numbers, comma-separated", shown_default="all GPUs in order")
    tensor_parallel: bool = setting(
        False, "Split each layer across the GPUs (one process per GPU beyond the first) rather than layers across "
        "them.", Group.EXLLAMAV3)
    tensor_parallel_backend: TensorParallelBackend = setting(
        TensorParallelBackend.NATIVE, "How tensor-parallel processes exchange activations.", Group.EXLLAMAV3)
    draft_model: str = setting(
        "", "An EXL3 directory with the same vocabulary, whose proposals the model checks. Excludes "
        "`speculation = ngram`.", Group.EXLLAMAV3, values="a directory")
    ngram_match_min: int = setting(
        2, "With `speculation = ngram`: output tokens that must match earlier text before what followed it is "
        "drafted (TabbyAPI's default).", Group.EXLLAMAV3, values="at least 1")

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
    kind: EngineKind = setting(
        EngineKind.LLAMA_CPP, "`llama.cpp` (GGUF, CPU or GPU), `exllamav2` (EXL2/GPTQ/FP16 directory, CUDA) or "
        "`exllamav3` (EXL3/FP16/BF16 directory, CUDA). See [engines](engines.md#at-a-glance).", Group.SERVER,
        name="engine")
    model: str = setting(
        "default", "A GGUF file, or `default` for the embedded SmolLM2-135M-Instruct. For exllamav2 and exllamav3, a "
        "model directory. A local path, not a Hugging Face hub id ([your own model](getting-started.md#your-own-model)).",
        Group.SERVER, values="a path, or `default`")
    model_id: str = setting(
        "", "The name callers may put in a request's `model`.", Group.SERVER, values="text",
        shown_default="the model's name")
    context_length: int = setting(
        2048, "Most tokens one sequence holds, prompt and output together.", Group.SERVER, values="at least 16")
    max_batch_size: int = setting(
        8, "Sequences decoded together. On llama.cpp each owns `context_length` cache cells.", Group.SERVER,
        values="at least 1")
    speculation: SpeculationSetting = setting(
        SpeculationSetting.AUTO, "What a request that does not choose gets. `auto`: n-gram proposals on "
        "llama.cpp, checked only where that pays; on exllamav2 and exllamav3 off, or the draft model "
        "when one is set. `off`. "
        "`ngram`.", Group.SPECULATION)
    max_draft_tokens: int = setting(
        16, "Most proposed tokens checked in one step, for a request that does not say. exllamav2 checks at most "
        "8.", Group.SPECULATION, values=f"1 to {MAX_DRAFT_TOKENS}")
    max_queued_requests: int = setting(
        16, "Requests that may wait for a batch place. Beyond them a request is refused at once (see "
        "[fair sharing](engines.md#scheduling-and-fair-sharing)).", Group.SERVER, values="0 or more")
    max_queued_per_caller: int = setting(
        0, "One caller's requests waiting beyond those. `0`: `max_queued_requests`. Past both: "
        "`RESOURCE_EXHAUSTED` (`CALLER_OVER_LIMIT`).", Group.SCHEDULING, values="0 or more")
    fairness: FairnessSettings = field(default_factory=FairnessSettings)
    llamacpp: LlamaCppSettings = field(default_factory=LlamaCppSettings)
    exllamav2: ExLlamaV2Settings = field(default_factory=ExLlamaV2Settings)
    exllamav3: ExLlamaV3Settings = field(default_factory=ExLlamaV3Settings, metadata={"prefix": "exllamav3_"})
    constraint: ConstraintLimits = field(default_factory=ConstraintLimits, metadata={"prefix": "constraint_"})
    compile_threads: int = setting(
        1, "Threads for large constraint compiles. Sources up to 16 kB compile on one separate thread.",
        Group.CONSTRAINTS, values="at least 1")
    max_concurrent_compiles: int = setting(
        4, "Large compiles running or waiting at once. Beyond: `RESOURCE_EXHAUSTED` (`TOO_MANY_COMPILES`).",
        Group.CONSTRAINTS, values="at least 1")
    cache_events: bool = setting(
        False, "Track the cached prompt blocks and serve them as `WatchCacheEvents`. llama.cpp only, and needs "
        "`prefix_cache`.", Group.CACHE_EVENTS)
    cache_events_replay_batches: int = setting(
        10_000, "Batches kept for replay; an older start gets a snapshot.", Group.CACHE_EVENTS,
        values="at least 1")

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
