"""The llama.cpp engine: a GGUF model served by one worker thread."""

from __future__ import annotations

import pathlib

from backend.config import EngineConfig, LlamaCppSettings
from backend.constraints import ConstraintCompiler
from backend.llamacpp.cache_events import block_size
from backend.llamacpp.core import LlamaCppCore
from backend.llamacpp.model import GgufModel
from backend.llamacpp.sampling import SUPPORTED_SAMPLERS
from backend.local_engine import WorkerEngine
from backend.tools import ReasoningFormat, ToolFormat, detect_format, detect_reasoning
from backend.types import (
    ALL_REQUEST_FEATURES,
    CONSTRAINT_KINDS,
    ModelInfo,
    PrefixReuse,
    SpeculationMode,
    SpeculationParams,
)


class LlamaCppEngine(WorkerEngine):
    def __init__(self, model_path: pathlib.Path, config: EngineConfig = EngineConfig(), model_id: str = "") -> None:
        own = config.llamacpp
        self.model = GgufModel(model_path, own.gpu_layers)
        self.vocabulary = self.model  # the model tokenizes and renders chats itself
        core = LlamaCppCore(self.model, config)
        self.info = ModelInfo(
            model_id=model_id or self.model.name,
            engine="llama.cpp",
            context_length=core.context_length,
            vocab_size=self.model.vocab_size,
            max_batch_size=config.max_batch_size,
            bos_token_id=self.model.bos_token_id,
            eos_token_ids=self.model.eos_token_ids,
            has_chat_template=self.model.chat_template is not None,
            samplers=SUPPORTED_SAMPLERS,
            constraint_kinds=CONSTRAINT_KINDS,
            quantization=self.model.quantization,
            speculation_modes=(SpeculationMode.OFF, SpeculationMode.NGRAM),
            default_speculation=SpeculationParams(config.speculation_mode(SpeculationMode.NGRAM), config.max_draft_tokens),
            request_features=ALL_REQUEST_FEATURES,
            template_tool_format=_name(detect_format(self.model.chat_template or "")),
            template_reasoning_format=_name(detect_reasoning(self.model.chat_template or "")),
            attention_provider="llama.cpp",  # its own kernels (flash attention where the build has it)
            cache_block_size=block_size(own.prefix_cache_exact) if core.cache_events is not None else 0,
            reuses_decoded_cells=own.prefix_cache and own.prefix_cache_generated and not own.prefix_cache_exact,
            prefix_reuse=_prefix_reuse(own),
        )
        self.cache_events = core.cache_events.hub if core.cache_events is not None else None
        constraints = ConstraintCompiler(self.model.constraint_tokenizer(), limits=config.constraint)
        self._serve(core, constraints, config, name="llama.cpp-engine")

    def close(self) -> None:
        self._stop()
        self.model.close()


def _prefix_reuse(settings: LlamaCppSettings) -> PrefixReuse:
    if not settings.prefix_cache:
        return PrefixReuse.OFF
    return PrefixReuse.EXACT if settings.prefix_cache_exact else PrefixReuse.AS_CACHED


def _name(found: ToolFormat | ReasoningFormat | None) -> str:
    return found.name if found else ""
