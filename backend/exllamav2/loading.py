"""Loading exllamav2 and a model into it: weights it cannot load, what a failed import means, and which
comes first, model or cache."""

from __future__ import annotations

import pathlib
import traceback
from typing import Any

from backend.config import EngineConfig
from backend.engine import EngineUnavailable
from backend.exllama.model_files import find_model_dir, model_config, tensor_headers
from backend.exllamav2.binding import Loaded
from backend.exllamav2.sizes import GeneratorSizes

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


def load(exllamav2: Any, xconfig: Any, config: EngineConfig, sizes: GeneratorSizes) -> Loaded:
    """The model, its cache and tokenizer, and the draft model the settings name with its cache, which must
    have the main one's size (dynamic.py:345-351) and vocabulary."""
    own = config.exllamav2
    configure(xconfig, sizes)
    model, cache = load_model_and_cache(exllamav2, xconfig, own.cache_type, sizes.cache_tokens, own.gpu_split)
    draft = {}
    if own.draft_model:
        draft_config = exllamav2.ExLlamaV2Config(str(find_model_dir(own.draft_model, "draft_model", "exllamav2")))
        draft_config.arch_compat_overrides()
        if draft_config.vocab_size != xconfig.vocab_size:
            raise EngineUnavailable(
                f"draft_model: its vocabulary has {draft_config.vocab_size} tokens, the model's {xconfig.vocab_size}"
            )
        configure(draft_config, sizes)
        draft_model, draft_cache = load_model_and_cache(
            exllamav2, draft_config, own.cache_type, sizes.cache_tokens, own.gpu_split
        )
        draft = {"draft_model": draft_model, "draft_cache": draft_cache}
    return Loaded(model, cache, exllamav2.ExLlamaV2Tokenizer(xconfig, lazy_init=False), draft)


def configure(xconfig: Any, sizes: GeneratorSizes) -> None:
    """A model config set to the generator's sizes, before its model is built."""
    xconfig.max_seq_len = sizes.max_seq_len
    xconfig.max_input_len = sizes.chunk
    xconfig.max_attention_size = sizes.chunk**2


def unloadable_weights(model_dir: pathlib.Path) -> str:
    """Why exllamav2 0.3.2 cannot load these weights, or "". Its GPTQ kernel takes only 4-bit weights,
    8 to an int32 (ext_qmatrix.cpp:66 checks qweight's columns against qzeros' times 8), and it never
    reads quantization_config.bits, so another width would fail inside the extension, on the GPU."""
    quantization = model_config(model_dir, "config.json").get("quantization_config") or {}
    bits, method = quantization.get("bits"), str(quantization.get("quant_method", "")).lower()
    if method == "exl3":
        return "exllamav2 cannot load EXL3 weights: set engine = exllamav3"
    if method == "gptq" and bits not in (None, 4):
        return f"exllamav2 loads only 4-bit GPTQ weights; this model's config.json says {bits}-bit"
    tensors = tensor_headers(model_dir)
    for name, header in tensors.items():
        zeros = tensors.get(name.removesuffix(".qweight") + ".qzeros")
        if name.endswith(".qweight") and zeros and header["shape"][1] != zeros["shape"][1] * 8:
            return f"exllamav2 loads only 4-bit GPTQ weights; {name} is not packed 8 to an int32"
    return ""
