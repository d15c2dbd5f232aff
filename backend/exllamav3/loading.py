"""Loading exllamav3 and a model into it: weights it cannot load, what a failed import means, and the order
1.6.5 needs (a cache is built before its model loads: Model.load allocates the caches attached to it, and
Generator.iterate asserts one built later was never allocated)."""

from __future__ import annotations

import pathlib

from backend.config import EngineConfig
from backend.engine import EngineUnavailable
from backend.exllama.model_files import find_model_dir, weight_format
from backend.exllamav3.binding import ExLlamaV3Classes, Loaded
from backend.exllamav3.sizes import GeneratorSizes, cache_fields, load_fields
from backend.types import SpeculationParams


def unavailable_message(exc: BaseException) -> str:
    """Why exllamav3 cannot be used here, for EngineUnavailable."""
    return (
        "the exllamav3 engine needs a CUDA build of torch (with Triton) and exllamav3, which compiles its extension "
        f"on first import unless a prebuilt exllamav3_ext imports (pip install 'tokenspout[exllamav3]'): "
        f"{type(exc).__name__}: {exc}"
    )


def unloadable_weights(model_dir: pathlib.Path) -> str:
    """Why exllamav3 cannot load these weights, or "": it loads EXL3 and unquantized weights only."""
    weights = weight_format(model_dir).split()[0]
    if weights in ("EXL2", "GPTQ"):
        return f"exllamav3 cannot load {weights} weights (EXL3, FP16 and BF16 only): set engine = exllamav2"
    return ""


def load(classes: ExLlamaV3Classes, model_dir: pathlib.Path, config: EngineConfig, sizes: GeneratorSizes,
         drafts: SpeculationParams) -> Loaded:
    """The model's config, the model and its cache and tokenizer, and the draft model the settings name, with a
    cache of the main one's size (Generator asserts it) and the same vocabulary; each cache before its model."""
    own = config.exllamav3
    model_config = classes.config.from_directory(str(model_dir))
    model = classes.model.from_config(model_config)
    cache = _cache(classes, model, sizes, drafts, config)
    draft = {}
    if own.draft_model:
        draft_config = classes.config.from_directory(
            str(find_model_dir(own.draft_model, "exllamav3_draft_model", "exllamav3"))
        )
        if draft_config.vocab_size != model_config.vocab_size:
            raise EngineUnavailable(f"exllamav3_draft_model: its vocabulary has {draft_config.vocab_size} tokens, "
                                    f"the model's {model_config.vocab_size}")
        draft_model = classes.model.from_config(draft_config)
        draft = {"draft_model": draft_model, "draft_cache": _cache(classes, draft_model, sizes, drafts, config)}
        draft_model.load(**load_fields(sizes, own, tensor_parallel=False))
    model.load(**load_fields(sizes, own, own.tensor_parallel))
    return Loaded(model_config, model, cache, classes.tokenizer.from_config(model_config), draft)


def _cache(classes: ExLlamaV3Classes, model: object, sizes: GeneratorSizes, drafts: SpeculationParams,
           config: EngineConfig) -> object:
    layer = classes.quant_layer if config.exllamav3.cache_bits else classes.fp16_layer
    return classes.cache(model, layer_type=layer, **cache_fields(sizes, drafts, config.exllamav3))
