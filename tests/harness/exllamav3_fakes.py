"""exllamav3 1.6.5's own part of the exllama doubles (the shared part: tests/harness/exllama_fakes.py).

- signatures: the Generator, Job, Cache, Model.load, Filter and every sampling step take only the keyword
  arguments 1.6.5's have (the lists below, pinned from its source and compared with it by
  tests/backend/exllamav3/test_signatures.py). The real Generator, Job and Cache swallow unknown ones in
  **kwargs, silently; the doubles refuse them. The steps assert what 1.6.5's assert of their values.
- a Job asserts max_new_tokens >= 1, and draws from random.Random(seed) (a fresh one without a seed).
- the page table under `generator.pagetable`; a Generator built over a cache makes the one before it
  refuse to iterate (Generator.__init__ and iterate: cache.owner_serial); close() lets its filter
  threads go.
- a job failure contained to its job: `reap[identifier] = error` makes the next iterate() end that job
  with a result of stage "error" carrying the job and the error but no identifier (reap_failed_job).
- the Filter base class: its constructor, and feed() as filter.py's (accept the token while active; on
  completion deactivate, and end the job where eos_after_completed).
- loading: Config.from_directory, Model.from_config, a Cache that only a later Model.load allocates.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import random
from types import SimpleNamespace
from typing import Any

import torch

from backend.config import EngineConfig
from backend.exllamav3.binding import ExLlamaV3Binding, ExLlamaV3Classes, Loaded
from backend.exllamav3.sizes import GeneratorSizes
from backend.exllamav3.sizes import speculation as drafting
from tests.harness import exllama_fakes
from tests.harness.exllama_fakes import PAGE_SIZE, FakeGenerators, FakeTokenizer

# From exllamav3 1.6.5 (the exllamav3-1.6.5-py3-none-any wheel on PyPI): the parameters of
# generator/generator.py Generator.__init__, generator/job.py Job.__init__, cache/cache.py Cache.__init__
# (whose **kwargs go to the layer type: cache/quant.py CacheLayer_quant's k_bits and v_bits),
# model/model.py Model.load_gen (Model.load passes its arguments on), generator/filter/filter.py
# Filter.__init__, and each sampling step's in generator/sampler/custom.py.
GENERATOR_PARAMETERS = frozenset({
    "model", "cache", "tokenizer", "max_batch_size", "max_chunk_size", "shared_chunk_size", "prefill_cooldown",
    "max_q_size", "draft_model", "draft_cache", "num_draft_tokens", "show_visualizer", "enable_defrag",
    "cpu_cache_size", "disk_cache_dir", "disk_cache_size", "disk_cache_flush_on_idle",
    "disk_cache_checkpoint_interval", "disk_cache_write_interval", "recurrent_cache_size",
    "recurrent_checkpoint_interval", "recurrent_checkpoint_interval_pp", "ngram_match_min", "dynamic_draft_tokens",
    "draft_confidence", "record_draft_stats", "ngram_corpus", "hybrid_draft_tokens", "draft_max_rows",
    "sparse_draft_head",
})
JOB_PARAMETERS = frozenset({
    "input_ids", "max_new_tokens", "min_new_tokens", "max_skips", "sampler", "seed", "stop_conditions",
    "decode_special_tokens", "return_top_tokens", "return_logits", "return_probs", "filters", "token_healing",
    "identifier", "banned_strings", "embeddings", "max_rq_tokens", "stop_on_loop", "rq_state",
})
CACHE_PARAMETERS = frozenset({"model", "max_num_tokens", "layer_type", "max_batch_size", "max_history", "recurrent_dtype"})
QUANT_LAYER_PARAMETERS = frozenset({"k_bits", "v_bits", "compand_a"})
LOAD_PARAMETERS = frozenset({
    "device", "tp_output_device", "reserve_per_device", "use_per_device", "tensor_p", "progressbar",
    "max_chunk_size", "max_output_size", "max_output_factor", "callback", "generator", "tp_dev_limits",
    "tp_backend", "verbose", "max_batch_size", "tp_options", "autosplit_no_forward", "draft_model",
})
FILTER_PARAMETERS = frozenset({"tokenizer", "trigger_token", "prefix_str", "eos_after_completed"})
STEP_PARAMETERS = {
    "SS_LogitBias": frozenset({"logit_bias"}),
    "SS_RepP": frozenset({"rep_p", "sustain_range", "decay_range"}),
    "SS_PresFreqP": frozenset({"pres_p", "freq_p", "sustain_range", "decay_range"}),
    "SS_DRY": frozenset({"dry_multiplier", "dry_base", "dry_allowed_length", "dry_range", "dry_sequence_breakers",
                         "tokenizer"}),
    "SS_TopK": frozenset({"top_k"}),
    "SS_TopP": frozenset({"top_p"}),
    "SS_MinP": frozenset({"min_p"}),
    "SS_XTC": frozenset({"probability", "threshold", "protected_token_ids", "tokenizer"}),
    "SS_Temperature": frozenset({"temperature"}),
    "SS_Sample": frozenset(),
    "SS_Argmax": frozenset(),
}
# What the steps assert of their values (custom.py): each check must hold.
_STEP_CHECKS = {
    "SS_TopK": lambda a: float(a["top_k"]).is_integer(),
    "SS_TopP": lambda a: 0.0 <= a["top_p"] <= 1.0,
    "SS_MinP": lambda a: 0.0 <= a["min_p"] <= 1.0,
    "SS_XTC": lambda a: 0.0 <= a["probability"] <= 1.0 and 0.0 <= a["threshold"] <= 1.0,
    "SS_DRY": lambda a: a["dry_multiplier"] >= 0.0 and a["dry_allowed_length"] >= 0,
}


def _step(name: str) -> type:
    class Step:
        def __init__(self, **arguments: Any) -> None:
            unknown = set(arguments) - STEP_PARAMETERS[name]
            if unknown:
                raise TypeError(f"{name}.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
            assert _STEP_CHECKS.get(name, lambda a: True)(arguments), f"{name} asserts on {arguments}"
            self.name, self.arguments = name, arguments

    Step.__name__ = name
    return Step


class CustomSampler:
    def __init__(self, steps: list) -> None:
        self.steps = steps

    @property
    def names(self) -> list[str]:
        return [step.name for step in self.steps]


sampling = SimpleNamespace(CustomSampler=CustomSampler, **{name: _step(name) for name in STEP_PARAMETERS})
"""exllamav3.generator.sampler, as far as the binding builds samplers."""


class FakeJob(exllama_fakes.FakeJob):
    PARAMETERS = JOB_PARAMETERS

    def __init__(self, input_ids: Any, **kwargs: Any) -> None:
        assert kwargs.get("max_new_tokens") is None or kwargs["max_new_tokens"] >= 1, \
            "max_new_tokens must be >= 1, or None for no limit"
        super().__init__(input_ids, **kwargs)
        self.sampler = kwargs.get("sampler")
        seed = kwargs.get("seed")
        self.rng = random.Random() if seed is None else random.Random(seed)


class FakeGenerator(exllama_fakes.FakeGenerator):
    def __init__(self, model: Any, cache: Any, tokenizer: Any, **fields: Any) -> None:
        unknown = set(fields) - GENERATOR_PARAMETERS
        assert not unknown, f"1.6.5's Generator would drop these silently: {sorted(unknown)}"
        super().__init__(cache.max_num_tokens, PAGE_SIZE)
        self.fields = fields
        cache.owner_serial = getattr(cache, "owner_serial", 0) + 1  # a cache has exactly one owning generator
        self._cache, self._owner_serial = cache, cache.owner_serial
        self.pagetable = SimpleNamespace(all_pages=self.pages)
        self.filter_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
        self.closed = False
        self.reap: dict[str, BaseException] = {}

    def iterate(self) -> list[dict]:
        if self._cache.owner_serial != self._owner_serial:
            raise RuntimeError("This Generator no longer owns its Cache: a newer Generator was created over the same Cache.")
        reaped = []
        for job in [job for job in self.active if job.identifier in self.reap]:
            self._finish(job)
            reaped.append({"job": job, "serial": 1, "stage": "error", "eos": True, "error": self.reap.pop(job.identifier)})
        return reaped + super().iterate()

    def close(self) -> None:
        self.closed = True
        self.filter_pool.shutdown(wait=False)

    def threads_stopped(self) -> bool:
        return self.closed


class FakeFilter:
    """exllamav3.Filter: its constructor and feed() (filter.py), without the journal a banned-string rewind replays."""

    def __init__(self, tokenizer: Any, trigger_token: int | None, prefix_str: str | None,
                 eos_after_completed: bool) -> None:
        self.tokenizer, self.trigger_token, self.prefix_str = tokenizer, trigger_token, prefix_str
        self.eos_after_completed = eos_after_completed
        self.is_active = trigger_token is None

    def feed(self, token: int) -> bool:
        if not self.is_active:
            return False
        self.accept_token(token)
        if self.is_completed():
            self.is_active = False
            return self.eos_after_completed
        return False


class FakeModelConfig:
    """Config.from_directory's result, as far as the engine reads it."""

    def __init__(self, directory: str, vocab_size: int = 64) -> None:
        self.directory, self.vocab_size = directory, vocab_size

    @staticmethod
    def from_directory(directory: str) -> FakeModelConfig:
        config = json.loads((pathlib.Path(directory) / "config.json").read_text())
        return FakeModelConfig(directory, config["vocab_size"])


class FakeModel:
    """Model: from_config; load() allocates the caches built over it before (Cache.initialized)."""

    def __init__(self, config: FakeModelConfig) -> None:
        self.config, self.caches, self.loaded_with = config, [], None

    @staticmethod
    def from_config(config: FakeModelConfig) -> FakeModel:
        return FakeModel(config)

    def load(self, **arguments: Any) -> None:
        unknown = set(arguments) - LOAD_PARAMETERS
        assert not unknown, f"Model.load_gen has no {sorted(unknown)}"
        self.loaded_with = arguments
        for cache in self.caches:
            cache.initialized = True

    def unload(self) -> None:
        self.loaded_with = None


class FakeCache:
    def __init__(self, model: FakeModel, **arguments: Any) -> None:
        layer = arguments.get("layer_type")
        allowed = CACHE_PARAMETERS | (QUANT_LAYER_PARAMETERS if layer is QuantLayer else frozenset())
        unknown = set(arguments) - allowed
        assert not unknown, f"Cache (layer {getattr(layer, '__name__', layer)}) has no {sorted(unknown)}"
        if layer is QuantLayer:
            assert 2 <= arguments["k_bits"] <= 8 and 2 <= arguments["v_bits"] <= 8, "quantized cache must be 2 to 8 bits"
        assert arguments["max_num_tokens"] % PAGE_SIZE == 0, "max_num_tokens must be a multiple of 256"
        self.model, self.arguments, self.max_num_tokens = model, arguments, arguments["max_num_tokens"]
        self.initialized = False
        model.caches.append(self)


class Fp16Layer:
    """CacheLayer_fp16"""


class QuantLayer:
    """CacheLayer_quant"""


class FakeTokenizerClass:
    @staticmethod
    def from_config(config: FakeModelConfig) -> FakeTokenizer:
        return FakeTokenizer(config.vocab_size)


def classes(generators: FakeGenerators) -> ExLlamaV3Classes:
    """exllamav3's classes as the binding and the loader use them, doubled."""
    return ExLlamaV3Classes(FakeModelConfig, FakeModel, FakeCache, Fp16Layer, QuantLayer, FakeTokenizerClass,
                            generators, FakeJob, FakeFilter, sampling, torch)


def binding(generators: FakeGenerators, vocab_size: int, eos_token_ids: tuple[int, ...], cache_tokens: int,
            config: EngineConfig) -> ExLlamaV3Binding:
    """The real exllamav3 binding over these doubles, with the engine's settings."""
    model_config = FakeModelConfig("model", vocab_size)
    model = FakeModel(model_config)
    cache = FakeCache(model, max_num_tokens=cache_tokens, layer_type=Fp16Layer)
    loaded = Loaded(model_config, model, cache, FakeTokenizer(vocab_size), {})
    sizes = GeneratorSizes(2048, config.max_batch_size, cache_tokens)
    return ExLlamaV3Binding(classes(generators), loaded, sizes, drafting(config, False), config.exllamav3, eos_token_ids)
