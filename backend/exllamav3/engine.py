"""The exllamav3 engine: an EXL3, FP16 or BF16 model directory served by one worker thread.

exllamav3 (and torch) are imported inside `ExLlamaV3Engine.__init__`: `import exllamav3` compiles its
CUDA extension unless a prebuilt one imports. It batches continuously over its own paged cache with its
own Triton attention kernels (no flash-attn). Not yet run on a GPU: its CPU side (the shared exllama
core, the job and sampler steps, the filter shell, the loading order, the vocabulary) is tested on CPU
against doubles checked with exllamav3 1.6.5's own source; the GPU check is GPU_CHECK_PLAN=exl3 bench/gpu/run.sh.
"""

from __future__ import annotations

import logging
import pathlib

from backend.config import EngineConfig
from backend.engine import EngineUnavailable
from backend.exllama.engine import ExllamaEngine, model_info
from backend.exllama.model_files import end_token_ids
from backend.exllama.vocabulary import folder_vocabulary
from backend.exllamav3.binding import ExLlamaV3Binding, import_classes
from backend.exllamav3.loading import load, unavailable_message, unloadable_weights
from backend.exllamav3.sampler import SUPPORTED_SAMPLERS
from backend.exllamav3.sizes import PAGE_SIZE, generator_sizes, reserve_tokens, speculation
from backend.types import PrefixReuse

log = logging.getLogger(__name__)

ATTENTION_PROVIDER = "exllamav3"
"""exllamav3's own paged attention (Triton kernels, 1.6.5 modules/attention_fn): named for the engine, not
the language, as no setting chooses it."""


class ExLlamaV3Engine(ExllamaEngine):
    def __init__(self, model_dir: pathlib.Path, config: EngineConfig = EngineConfig()) -> None:
        problem = unloadable_weights(model_dir)  # before the import, which may compile for minutes
        if problem:
            raise EngineUnavailable(problem)
        try:
            classes = import_classes()
        except (ImportError, OSError, RuntimeError) as exc:
            raise EngineUnavailable(unavailable_message(exc)) from exc
        sizes = generator_sizes(config)
        drafts = speculation(config, bool(config.exllamav3.draft_model))
        loaded = load(classes, model_dir, config, sizes, drafts)
        self.model = loaded.model
        eos_token_ids = end_token_ids(model_dir, loaded.tokenizer.eos_token_id)
        vocab_size = loaded.config.vocab_size
        self.vocabulary, template = folder_vocabulary(model_dir, vocab_size, loaded.tokenizer.bos_token_id, eos_token_ids)
        info = model_info(
            model_dir, config, template, engine="exllamav3", vocab_size=vocab_size, max_batch_size=sizes.batch,
            bos_token_id=loaded.tokenizer.bos_token_id, eos_token_ids=eos_token_ids, samplers=SUPPORTED_SAMPLERS,
            speculation_modes=(drafts.mode,), default_speculation=drafts, attention_provider=ATTENTION_PROVIDER,
            reuses_decoded_cells=True,  # completed pages of output are hashed and reused as decoded
            prefix_reuse=PrefixReuse.AS_CACHED,
            cache_tokens=sizes.cache_tokens, cache_page_tokens=PAGE_SIZE, cache_reserve_tokens=reserve_tokens(drafts),
        )
        log.info("exllamav3: %s, batch %d, cache %d tokens (%s), %s", info.quantization, sizes.batch,
                 sizes.cache_tokens, f"{config.exllamav3.cache_bits}-bit" if config.exllamav3.cache_bits else "FP16",
                 "tensor parallel" if config.exllamav3.tensor_parallel else "layers split")
        binding = ExLlamaV3Binding(classes, loaded, sizes, drafts, config.exllamav3, eos_token_ids)
        self._serve_generator(binding, info, config, "exllamav3-engine")

    def close(self) -> None:
        self._stop()
        self.model.unload()
