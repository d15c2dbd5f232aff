"""Loading exllamav2 and a model into it: what a failed import means, and which comes first, model or cache."""

from __future__ import annotations

import traceback
from typing import Any

CACHE_CLASSES = {"fp16": "ExLlamaV2Cache", "q4": "ExLlamaV2Cache_Q4", "q6": "ExLlamaV2Cache_Q6", "q8": "ExLlamaV2Cache_Q8"}


def unavailable_message(exc: BaseException) -> str:
    """Why exllamav2 cannot be used here, for EngineUnavailable. exllamav2.attn catches only a missing
    flash-attn (ModuleNotFoundError, attn.py:62-65): one that is installed but fails to import (built for
    another torch or CUDA) breaks `import exllamav2` itself; attention `sdpa` or `off` never imports it."""
    message = (
        "the exllamav2 engine needs a CUDA build of torch and exllamav2, which compiles its extension "
        f"on first import (pip install 'tokenspout[exllamav2]'): {type(exc).__name__}: {exc}"
    )
    frames = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    if any("flash_attn" in text for text in (str(exc), getattr(exc, "name", None) or "", *frames)):
        message += (
            "; flash-attn is installed but does not import: rebuild it for this torch and CUDA, remove it, or set "
            "attention = sdpa (tokenspout's paged attention) to run without it"
        )
    return message


def load_model_and_cache(
    exllamav2: Any, xconfig: Any, cache_type: str, cache_tokens: int, gpu_split: tuple[float, ...]
) -> tuple[Any, Any]:
    """(model, cache) on the GPUs. A cache built eagerly places each layer on the device in
    model.cache_map, which only load() and load_autosplit() fill (cache.py:85-90, model.py:348, 699-704):
    before them every layer would land on the CPU. So with a manual split the model loads first, as
    exllamav2's own model_init does; autosplit builds a lazy cache and allocates it while loading."""
    model = exllamav2.ExLlamaV2(xconfig)
    cache_class = getattr(exllamav2, CACHE_CLASSES[cache_type])
    if gpu_split:
        model.load(list(gpu_split))
        cache = cache_class(model, max_seq_len=cache_tokens)
    else:
        cache = cache_class(model, max_seq_len=cache_tokens, lazy=True)
        model.load_autosplit(cache)
    return model, cache
