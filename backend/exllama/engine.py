"""What both exllama engines share once their library has loaded the model: the vocabulary from the model
folder (backend.exllama.vocabulary), the ModelInfo fields the folder decides, and the core on its
worker thread over the generation's binding (backend.exllama.core, backend.exllama.binding)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from backend.config import EngineConfig
from backend.constraints import ConstraintCompiler
from backend.exllama.binding import GeneratorBinding
from backend.exllama.core import ExllamaCore
from backend.exllama.model_files import weight_format
from backend.exllama.results import Translation
from backend.exllama.vocabulary import FolderVocabulary
from backend.local_engine import WorkerEngine
from backend.tools import detect_format, detect_reasoning
from backend.types import CONSTRAINT_KINDS, ModelInfo

EXLLAMA_REQUEST_FEATURES = ("prompt_token_ids", "n", "truncate_input_tokens")
"""Token input and truncation are the service's; n samples are n jobs sharing the prompt's pages
(backend.exllama.job). Neither generator gives prompt logprobs, nor takes a salt for its page hashes:
UNIMPLEMENTED."""


def model_info(model_dir: pathlib.Path, config: EngineConfig, template: str | None, **own: Any) -> ModelInfo:
    """The engine's ModelInfo: what the folder and the settings say, and the engine's `own` fields (its name,
    vocabulary, batch, samplers, speculation, attention and cache)."""
    tool_format = detect_format(template) if template is not None else None
    reasoning = detect_reasoning(template) if template is not None else None
    return ModelInfo(
        model_id=config.model_id or model_dir.name,
        context_length=config.context_length,
        has_chat_template=template is not None,
        template_tool_format=tool_format.name if tool_format else "",
        template_reasoning_format=reasoning.name if reasoning else "",
        constraint_kinds=CONSTRAINT_KINDS,
        quantization=weight_format(model_dir),
        draft_tokens_per_request=False,  # the generator drafts the same for every job
        request_features=EXLLAMA_REQUEST_FEATURES,
        **own,
    )


class ExllamaEngine(WorkerEngine):
    """An exllama engine: the generation's binding served by the shared core, the vocabulary the folder's."""

    vocabulary: FolderVocabulary

    def _serve_generator(self, binding: GeneratorBinding, info: ModelInfo, config: EngineConfig, name: str) -> None:
        """Starts the core over `binding` on its thread; `config` as the engine runs it (`info` says its batch)."""
        self.info = info
        vocabulary = self.vocabulary
        translation = Translation(frozenset(info.eos_token_ids), vocabulary.piece, len(vocabulary.pieces),
                                  binding.suppressed_ids_stay)
        batched = dataclasses.replace(config, max_batch_size=info.max_batch_size)
        core = ExllamaCore(binding, translation, info.cache_tokens, batched)
        self._serve(core, ConstraintCompiler(vocabulary.ll_tokenizer, limits=config.constraint), batched, name)
