"""The engine contract: what the service (or any caller) needs from a model backend.

    types         requests and what an engine says about its model (neutral: no gRPC)
    events        what comes back for each sequence: tokens, finish, errors (neutral too)
    engine        the Engine protocol: submit, cancel, pause, resume, stats
    worker        the one thread that owns a model, driving an engine core step by step
    local_engine  an engine in this process: the protocol's commands over a core on its worker thread
    config        the engine's settings, checked when built
    setting       what an operator reads about a setting, declared on its field
    registry      builds the engine a config names

Everything a caller uses is exported here. The parts engines share (the core's
scaffold, the door, output bookkeeping, text, logprobs, fairness, chat templates,
stats, the model fetch, the KV-cache events) are in backend.common; each engine is a package of its own (backend.llamacpp, and the
two exllama generations backend.exllamav2 and backend.exllamav3 over the room they share,
backend.exllama); constraints are backend.constraints; an engine in a process of its own, and the
front ends' RemoteEngine that speaks to it, are backend.process. The names load when first asked
for (backend.lazy): importing the package costs nothing.
"""

from typing import TYPE_CHECKING

from backend.lazy import exports
from backend.setting import Group, SettingHelp, setting  # light; and `setting` must be the function, not its module

if TYPE_CHECKING:
    from backend.common.cache_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        CacheEvent,
        CacheEventBatch,
        CacheEventHub,
        CacheWatching,
    )
    from backend.common.chat import ChatTemplateError
    from backend.common.core import Output
    from backend.common.models import ModelError, default_model_path
    from backend.common.stats import CallerTally, EngineStats
    from backend.common.tokens import common_prefix
    from backend.config import (
        MAX_DRAFT_TOKENS,
        AttentionSetting,
        CacheType,
        EngineConfig,
        EngineKind,
        ExLlamaV2Settings,
        ExLlamaV3Settings,
        FairnessSettings,
        LlamaCppSettings,
        SchedulingPolicy,
        SpeculationSetting,
        TensorParallelBackend,
    )
    from backend.engine import Engine, EngineGone, EngineUnavailable, Vocabulary
    from backend.events import (
        ErrorEvent,
        ErrorKind,
        Event,
        EventBatcher,
        EventSink,
        Finish,
        FinishReason,
        GeneratedToken,
        Timings,
        TokenEvent,
        TopLogprob,
        Usage,
    )
    from backend.local_engine import WorkerEngine
    from backend.process.host import EngineHost
    from backend.process.remote import RemoteEngine
    from backend.registry import MODEL_RECIPE, EngineRecipe, build_engine
    from backend.types import (
        ALL_REQUEST_FEATURES,
        COMMON_SAMPLERS,
        CONSTRAINT_KINDS,
        DEFAULT_DRY_BREAKERS,
        SAMPLE_SEPARATOR,
        ChatContext,
        ChatMessage,
        DryParams,
        GenerationRequest,
        MirostatParams,
        ModelInfo,
        OutputParams,
        PrefixReuse,
        SamplingParams,
        Scheduling,
        SpeculationMode,
        SpeculationParams,
        StopParams,
        XtcParams,
    )
    from backend.worker import EngineCore, EngineWorker

__all__ = [
    "ALL_REQUEST_FEATURES",
    "AllBlocksCleared",
    "AttentionSetting",
    "BlockRemoved",
    "BlockStored",
    "build_engine",
    "CacheEvent",
    "CacheEventBatch",
    "CacheEventHub",
    "CacheType",
    "CacheWatching",
    "CallerTally",
    "ChatContext",
    "ChatMessage",
    "ChatTemplateError",
    "common_prefix",
    "COMMON_SAMPLERS",
    "CONSTRAINT_KINDS",
    "DEFAULT_DRY_BREAKERS",
    "default_model_path",
    "DryParams",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineGone",
    "EngineHost",
    "EngineKind",
    "EngineRecipe",
    "EngineStats",
    "EngineUnavailable",
    "EngineWorker",
    "ErrorEvent",
    "ErrorKind",
    "Event",
    "EventBatcher",
    "EventSink",
    "ExLlamaV2Settings",
    "ExLlamaV3Settings",
    "FairnessSettings",
    "Finish",
    "FinishReason",
    "GeneratedToken",
    "GenerationRequest",
    "Group",
    "LlamaCppSettings",
    "MAX_DRAFT_TOKENS",
    "MirostatParams",
    "MODEL_RECIPE",
    "ModelError",
    "ModelInfo",
    "Output",
    "OutputParams",
    "PrefixReuse",
    "RemoteEngine",
    "SAMPLE_SEPARATOR",
    "SamplingParams",
    "Scheduling",
    "SchedulingPolicy",
    "setting",
    "SettingHelp",
    "SpeculationMode",
    "SpeculationParams",
    "SpeculationSetting",
    "StopParams",
    "TensorParallelBackend",
    "Timings",
    "TokenEvent",
    "TopLogprob",
    "Usage",
    "Vocabulary",
    "WorkerEngine",
    "XtcParams",
]

if not TYPE_CHECKING:  # a type checker reads the imports above, and flags a name not among them
    __getattr__, __dir__ = exports(__name__, __file__, __all__)
