"""exllamav2 0.3.2's own part of the exllama doubles (the shared part: tests/harness/exllama_fakes.py).

- signatures: jobs, sampler settings and the generator take only the keyword arguments 0.3.2's have
  (SETTINGS_FIELDS, JOB_PARAMETERS, GENERATOR_PARAMETERS). The real ones swallow unknown ones in
  **kwargs, silently; the doubles refuse them, since one lost that way would show only on a GPU.
- the page table under the generator itself (all_pages); unpaged, one page is the whole cache.
- threads: the sampling and filter pools of 16 workers each that 0.3.2 starts per generator.
- the filter base class (ExLlamaV2Filter's constructor), for the binding's filter shell.
- loading (FakeLibrary): a model whose cache_map is empty until load() or load_autosplit(), and
  a cache that, built eagerly, puts each layer where cache_map says, the CPU where it says nothing.
"""

from __future__ import annotations

import concurrent.futures
import random
from typing import Any

import torch

from backend.config import EngineConfig
from backend.exllamav2.binding import ExLlamaV2Binding, ExLlamaV2Classes, Loaded
from backend.exllamav2.sizes import GeneratorSizes
from backend.exllamav2.sizes import speculation as drafting
from tests.harness import exllama_fakes
from tests.harness.core_driver import Delivering
from tests.harness.exllama_fakes import PAGE_SIZE, FakeGenerators, FakeTokenizer

# From exllamav2 v0.3.2 (turboderp-org/exllamav2, tag v0.3.2; the same files are in the
# exllamav2-0.3.2-py3-none-any wheel on PyPI): the fields of the ExLlamaV2Sampler.Settings dataclass
# (generator/sampler.py:51-96) and the parameters of ExLlamaV2DynamicJob.__init__
# (generator/dynamic.py:1602-1621) and ExLlamaV2DynamicGenerator.__init__ (dynamic.py:241-259).
# tests/backend/exllamav2/test_signatures.py compares them with that source whenever it is on this machine.
SETTINGS_FIELDS = frozenset({
    "token_repetition_penalty", "token_repetition_range", "token_repetition_decay", "token_frequency_penalty",
    "token_presence_penalty", "temperature", "smoothing_factor", "min_temp", "max_temp", "temp_exponent", "top_k",
    "top_p", "top_a", "min_p", "tfs", "typical", "skew", "temperature_last", "mirostat", "mirostat_tau",
    "mirostat_eta", "mirostat_mu", "token_bias", "cfg_scale", "post_sampling_hooks", "dry_allowed_length",
    "dry_base", "dry_multiplier", "dry_sequence_breakers", "dry_range", "dry_max_ngram", "ngram_trie",
    "ngram_index", "ngram_history", "xtc_probability", "xtc_threshold", "xtc_ignore_tokens",
})
JOB_PARAMETERS = frozenset({
    "input_ids", "max_new_tokens", "min_new_tokens", "max_skips", "gen_settings", "seed", "stop_conditions",
    "decode_special_tokens", "return_top_tokens", "return_logits", "return_probs", "filters",
    "filter_prefer_eos", "token_healing", "identifier", "banned_strings", "embeddings",
})
GENERATOR_PARAMETERS = frozenset({
    "model", "cache", "tokenizer", "max_batch_size", "max_seq_len", "max_chunk_size", "max_q_size", "draft_model",
    "draft_cache", "num_draft_tokens", "use_ngram_draft", "max_ngram", "max_sampling_threads",
    "min_sampling_threads", "paged", "filter_background_eval",
})


class FakeSettings:
    """ExLlamaV2Sampler.Settings: a dataclass, so an unknown keyword is a TypeError, as there."""

    token_bias = None

    def __init__(self, **fields) -> None:
        unknown = set(fields) - SETTINGS_FIELDS
        if unknown:
            raise TypeError(f"Settings.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.__dict__.update(fields)


class FakeJob(exllama_fakes.FakeJob):
    """ExLlamaV2DynamicJob: its random generator is random.Random(seed) (dynamic.py:1740)."""

    PARAMETERS = JOB_PARAMETERS

    def __init__(self, input_ids: Any, **kwargs: Any) -> None:
        super().__init__(input_ids, **kwargs)
        self.gen_settings = kwargs.get("gen_settings")
        self.rng = random.Random(kwargs.get("seed"))


class FakeGenerator(exllama_fakes.FakeGenerator):
    """ExLlamaV2DynamicGenerator: its page table under the generator, and its two 16-worker pools."""

    def __init__(self, model: Any, cache: Any, tokenizer: Any, **fields: Any) -> None:
        unknown = set(fields) - GENERATOR_PARAMETERS
        assert not unknown, f"0.3.2's generator would drop these silently: {sorted(unknown)}"
        paged = fields.get("paged", True)
        super().__init__(cache.max_seq_len, PAGE_SIZE if paged else cache.max_seq_len)
        self.fields = fields
        self.sampling_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
        self.filter_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)

    @property
    def all_pages(self) -> list[exllama_fakes.FakePage]:
        return self.pages

    def threads_stopped(self) -> bool:
        """Both pools shut down (a submit to either raises)."""
        stopped = []
        for pool in (self.sampling_pool, self.filter_pool):
            try:
                pool.submit(int).result()
                stopped.append(False)
            except RuntimeError:
                stopped.append(True)
        return all(stopped)


class FakeFilter:
    """ExLlamaV2Filter's constructor (filters/base.py:14-30): subclasses must call it."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer, self.sequence_str, self.background_result = model, tokenizer, "", None


class FakeModel:
    """ExLlamaV2: cache_map (layer -> device) stays empty until a load fills it (model.py:89, 348, 699-704)."""

    layers = 4

    def __init__(self, config) -> None:
        self.config = config
        self.cache_map: dict[int, str] = {}

    def load(self, gpu_split: list[float]) -> None:
        self.cache_map = {layer: f"cuda:{layer * len(gpu_split) // self.layers}" for layer in range(self.layers)}

    def load_autosplit(self, cache: FakeCache) -> None:
        assert cache.lazy, "load_autosplit allocates a lazy cache as it loads"
        self.cache_map = {layer: "cuda:0" for layer in range(self.layers)}
        cache.devices = [self.cache_map[layer] for layer in range(self.layers)]


class FakeCache:
    """ExLlamaV2Cache: built eagerly, each layer goes to model.cache_map's device, or the CPU (None)
    where the map has none (cache.py:85-90); a lazy one is allocated by load_autosplit."""

    def __init__(self, model: FakeModel, max_seq_len: int = -1, lazy: bool = False) -> None:
        self.max_seq_len, self.lazy = max_seq_len, lazy
        self.devices = None if lazy else [model.cache_map.get(layer) for layer in range(model.layers)]


class FakeLibrary:
    """The `exllamav2` module, as far as loading a model and its cache goes."""

    ExLlamaV2 = FakeModel
    ExLlamaV2Cache = ExLlamaV2Cache_Q4 = ExLlamaV2Cache_Q6 = ExLlamaV2Cache_Q8 = FakeCache


def no_breakers(breakers: tuple[str, ...]) -> frozenset[int]:
    return frozenset()


def binding(generators: FakeGenerators, vocab_size: int, eos_token_ids: tuple[int, ...], cache_tokens: int,
            config: EngineConfig) -> ExLlamaV2Binding:
    """The real exllamav2 binding over these doubles, paged, with the engine's settings."""
    classes = ExLlamaV2Classes(generators, FakeJob, FakeSettings, FakeFilter, torch)
    model = FakeModel(None)
    loaded = Loaded(model, FakeCache(model, max_seq_len=cache_tokens), FakeTokenizer(vocab_size), {})
    sizes = GeneratorSizes(config.context_length, 2048, config.max_batch_size, cache_tokens, paged=True)
    return ExLlamaV2Binding(classes, loaded, sizes, drafting(config, False), eos_token_ids, vocab_size)


def fake_core(vocab_size: int = 64, **settings: object) -> tuple[Delivering, FakeGenerators]:
    """The shared core over exllamav2's binding on these doubles, driven step by step, and its generators."""
    return exllama_fakes.fake_core("exllamav2", vocab_size, **settings)

