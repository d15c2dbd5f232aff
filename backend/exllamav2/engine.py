"""The exllamav2 engine: an EXL2, GPTQ or FP16 model directory served by one worker thread.

Everything exllamav2 (and torch) is imported inside `ExLlamaV2Engine.__init__`: `import exllamav2`
compiles a CUDA extension. It ran on an H200 (docs/benchmarks.md); its CPU side (the shared exllama
core, job and sampler fields, the filter core, the generator's sizes, the model-then-cache order, the
vocabulary) is tested on CPU against doubles that behave like exllamav2 0.3.2 and real tokenizers.
"""

from __future__ import annotations

import logging
import pathlib

from backend.config import EngineConfig
from backend.engine import EngineUnavailable
from backend.exllama.engine import ExllamaEngine, model_info
from backend.exllama.model_files import end_token_ids
from backend.exllama.vocabulary import folder_vocabulary
from backend.exllamav2.attention_provider import NONE, describe, import_exllamav2
from backend.exllamav2.binding import ExLlamaV2Binding, import_classes
from backend.exllamav2.loading import load, unavailable_message, unloadable_weights
from backend.exllamav2.settings import SUPPORTED_SAMPLERS
from backend.exllamav2.sizes import PAGE_SIZE, generator_sizes, speculation
from backend.types import PrefixReuse

log = logging.getLogger(__name__)


class ExLlamaV2Engine(ExllamaEngine):
    def __init__(self, model_dir: pathlib.Path, config: EngineConfig = EngineConfig()) -> None:
        problem = unloadable_weights(model_dir)  # before the import, which compiles for minutes
        if problem:
            raise EngineUnavailable(problem)
        try:  # importing exllamav2 compiles its CUDA extension, which can fail in many ways
            exllamav2, provider = import_exllamav2(config.exllamav2.attention)
            from exllamav2.attn import has_flash_attn_with_paged

            classes = import_classes()
        except (ImportError, OSError, RuntimeError) as exc:
            raise EngineUnavailable(unavailable_message(exc)) from exc
        xconfig = exllamav2.ExLlamaV2Config(str(model_dir))
        xconfig.arch_compat_overrides()
        try:
            sizes = generator_sizes(config, has_flash_attn_with_paged, xconfig.no_flash_attn)
        except ValueError as exc:
            raise EngineUnavailable(f"exllamav2 cannot run with these settings: {exc}") from exc
        if not sizes.paged:
            why = "this model turns paged attention off" if has_flash_attn_with_paged else f"attention {provider}"
            log.warning("%s: exllamav2 runs unpaged, one request at a time", why)
            provider = NONE
        log.info(describe(provider, sizes.paged, sizes.batch))
        loaded = load(exllamav2, xconfig, config, sizes)
        self.model = loaded.model
        drafts = speculation(config, bool(loaded.draft))
        eos_token_ids = end_token_ids(model_dir, loaded.tokenizer.eos_token_id)
        self.vocabulary, template = folder_vocabulary(model_dir, xconfig.vocab_size, loaded.tokenizer.bos_token_id,
                                                      eos_token_ids)
        info = model_info(
            model_dir, config, template,
            engine="exllamav2" if sizes.paged else "exllamav2 (unpaged: one request at a time)",
            vocab_size=xconfig.vocab_size, max_batch_size=sizes.batch,
            bos_token_id=loaded.tokenizer.bos_token_id, eos_token_ids=eos_token_ids, samplers=SUPPORTED_SAMPLERS,
            speculation_modes=(drafts.mode,), default_speculation=drafts, attention_provider=provider,
            reuses_decoded_cells=sizes.paged,  # its cache pages keep generated tokens as decoded
            prefix_reuse=PrefixReuse.AS_CACHED if sizes.paged else PrefixReuse.OFF,
            cache_tokens=sizes.cache_tokens, cache_page_tokens=PAGE_SIZE,
        )
        binding = ExLlamaV2Binding(classes, loaded, sizes, drafts, eos_token_ids, xconfig.vocab_size)
        self._serve_generator(binding, info, config, "exllamav2-engine")

    def close(self) -> None:
        self._stop()
        self.model.unload()
