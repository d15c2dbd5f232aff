"""Builds the engine a config names: the one place that knows every engine and where its model is."""

from __future__ import annotations

import pathlib

from backend.config import EngineConfig, EngineKind
from backend.engine import Engine
from backend.models import DEFAULT_MODEL_ID, ModelError, resolve_model_path


def build_engine(config: EngineConfig) -> Engine:
    """Loads the model and starts its engine thread. Raises ModelError or EngineUnavailable."""
    if config.kind is EngineKind.EXLLAMAV2:
        from backend.exllamav2.engine import ExLlamaV2Engine

        return ExLlamaV2Engine(exllamav2_model_dir(config.model), config)
    from backend.llamacpp.engine import LlamaCppEngine

    path = resolve_model_path(config.model)
    model_id = config.model_id or (DEFAULT_MODEL_ID if config.model == "default" else path.stem)
    return LlamaCppEngine(path, config, model_id)


def exllamav2_model_dir(model: str) -> pathlib.Path:
    model_dir = pathlib.Path(model).expanduser()
    missing = [name for name in ("config.json", "tokenizer.json") if not (model_dir / name).is_file()]
    if missing:  # exllamav2 reads only tokenizer.json; SentencePiece-only models are not supported
        raise ModelError(
            f"exllamav2 needs a model directory with config.json and tokenizer.json; {model_dir} lacks {', '.join(missing)}"
        )
    return model_dir
