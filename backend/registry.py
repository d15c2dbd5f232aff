"""Builds the engine a config names: the one place that knows every engine and where its model is.

An `EngineRecipe` makes an engine and, apart, its vocabulary: with the engine in a process of its own
(backend.process), each front end tokenizes and renders chats with a vocabulary of its own, loaded
from the model's files without its weights. A recipe is picklable: processes are started with it.
"""

from __future__ import annotations

from typing import Protocol

from backend.common.models import DEFAULT_MODEL_ID, resolve_model_path
from backend.config import EngineConfig, EngineKind
from backend.engine import Vocabulary
from backend.exllama.model_files import find_model_dir
from backend.local_engine import WorkerEngine
from backend.types import ModelInfo


class EngineRecipe(Protocol):
    def engine(self, config: EngineConfig) -> WorkerEngine:
        """Loads the model and starts its engine thread. Raises ModelError or EngineUnavailable."""
        ...

    def vocabulary(self, config: EngineConfig, info: ModelInfo) -> Vocabulary:
        """The model's vocabulary alone, as the engine `info` describes runs it."""
        ...


class ModelRecipe:
    """The engine the config names, on its model."""

    def engine(self, config: EngineConfig) -> WorkerEngine:
        if config.kind is EngineKind.EXLLAMAV2:
            from backend.exllamav2.engine import ExLlamaV2Engine

            return ExLlamaV2Engine(find_model_dir(config.model, "model", config.kind), config)
        if config.kind is EngineKind.EXLLAMAV3:
            from backend.exllamav3.engine import ExLlamaV3Engine

            return ExLlamaV3Engine(find_model_dir(config.model, "model", config.kind), config)
        from backend.llamacpp.engine import LlamaCppEngine

        path = resolve_model_path(config.model)
        model_id = config.model_id or (DEFAULT_MODEL_ID if config.model == "default" else path.stem)
        return LlamaCppEngine(path, config, model_id)

    def vocabulary(self, config: EngineConfig, info: ModelInfo) -> Vocabulary:
        if config.kind in (EngineKind.EXLLAMAV2, EngineKind.EXLLAMAV3):  # from the folder, without the library
            from backend.exllama.vocabulary import load_vocabulary

            return load_vocabulary(find_model_dir(config.model, "model", config.kind), info)
        from backend.llamacpp.model import GgufModel

        return GgufModel(resolve_model_path(config.model), vocab_only=True)


MODEL_RECIPE = ModelRecipe()


def build_engine(config: EngineConfig) -> WorkerEngine:
    """Loads the model the config names and starts its engine thread. Raises ModelError or EngineUnavailable."""
    return MODEL_RECIPE.engine(config)
