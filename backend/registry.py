"""Builds the engine a config names: the one place that knows every engine and where its model is."""

from __future__ import annotations

from backend.common.models import DEFAULT_MODEL_ID, resolve_model_path
from backend.config import EngineConfig, EngineKind
from backend.engine import Engine
from backend.exllamav2.model_files import find_model_dir


def build_engine(config: EngineConfig) -> Engine:
    """Loads the model and starts its engine thread. Raises ModelError or EngineUnavailable."""
    if config.kind is EngineKind.EXLLAMAV2:
        from backend.exllamav2.engine import ExLlamaV2Engine

        return ExLlamaV2Engine(find_model_dir(config.model, "model"), config)
    from backend.llamacpp.engine import LlamaCppEngine

    path = resolve_model_path(config.model)
    model_id = config.model_id or (DEFAULT_MODEL_ID if config.model == "default" else path.stem)
    return LlamaCppEngine(path, config, model_id)
