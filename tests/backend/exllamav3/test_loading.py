"""Starting the exllamav3 engine, on CPU: its settings and the rules between them, the generator's sizes and the
budget a job reserves, the order 1.6.5 needs (each cache before its model loads), the draft model's checks,
weights it cannot load, and what a failed import says."""

from __future__ import annotations

import json
import re

import pytest

from backend.config import EngineConfig, EngineKind, SpeculationSetting, TensorParallelBackend
from backend.engine import EngineUnavailable
from backend.exllamav3.loading import load, unavailable_message, unloadable_weights
from backend.exllamav3.sizes import generator_fields, generator_sizes, reserve_tokens, speculation
from backend.types import ModelInfo, SpeculationMode
from service.config import load_config
from tests.harness import exllamav3_fakes as fakes
from tests.harness.exllama_fakes import EOS, FakeGenerators, safetensors_with


def config(**settings) -> EngineConfig:
    return EngineConfig.of(kind=EngineKind.EXLLAMAV3, **settings)


def test_the_cache_and_the_chunk_are_whole_pages():
    sizes = generator_sizes(config(context_length=1000, max_batch_size=3))
    assert (sizes.cache_tokens, sizes.chunk, sizes.batch) == (3072, 1024, 3)  # 3 x 1000 rounded up to 256
    assert generator_sizes(config(context_length=4096)).chunk == 2048
    assert generator_sizes(config(context_length=1000, cache_tokens=3000)).cache_tokens == 3072


@pytest.mark.parametrize("setting, draft_model, mode", [
    ("auto", False, SpeculationMode.OFF), ("off", False, SpeculationMode.OFF), ("ngram", False, SpeculationMode.NGRAM),
    ("auto", True, SpeculationMode.DRAFT_MODEL),
])
def test_the_generator_drafts_as_the_server_says(setting, draft_model, mode):
    engine = config(speculation=SpeculationSetting(setting), max_draft_tokens=6, ngram_match_min=3)
    drafts = speculation(engine, draft_model)
    fields = generator_fields(generator_sizes(engine), drafts, engine.exllamav3)
    assert drafts.mode is mode
    assert fields.get("num_draft_tokens") == (None if mode is SpeculationMode.OFF else 6)
    assert fields.get("ngram_match_min") == (3 if mode is SpeculationMode.NGRAM else None)
    assert reserve_tokens(drafts) == (1 if mode is SpeculationMode.OFF else 7)


def test_a_job_that_would_not_fit_its_reserve_is_refused_before_it_is_queued():
    # 1.6.5 reserves prompt + max_new_tokens + 1 (+ the drafts' window) and quietly shortens max_new_tokens to
    # fit: the service refuses what would be shortened (OUT_OF_RANGE) rather than end it early as MAX_TOKENS.
    info = ModelInfo("m", "exllamav3", 4096, 64, 1, 1, EOS, False, (), cache_tokens=512, cache_page_tokens=256,
                     cache_reserve_tokens=1)
    assert info.budget_problem(100, 411) == ""
    assert "3 cache pages; the cache has 2" in info.budget_problem(100, 412)
    drafting = ModelInfo("m", "exllamav3", 4096, 64, 1, 1, EOS, False, (), cache_tokens=512, cache_page_tokens=256,
                         cache_reserve_tokens=7)
    assert drafting.budget_problem(100, 405) == "" and drafting.budget_problem(100, 406)


@pytest.mark.parametrize("settings, message", [
    ({"cache_bits": 1}, "exllamav3_cache_bits must be 0 (FP16) or 2 to 8"),
    ({"cache_bits": 9}, "exllamav3_cache_bits must be 0 (FP16) or 2 to 8"),
    ({"cache_v_bits": 4}, "exllamav3_cache_v_bits needs exllamav3_cache_bits"),
    ({"cache_bits": 4, "cache_v_bits": 12}, "exllamav3_cache_v_bits must be 0 or 2 to 8"),
    ({"gpu_split": (20.0, 0.0)}, "every GPU's share must be positive"),
    ({"ngram_match_min": 0}, "exllamav3_ngram_match_min must be at least 1"),
    ({"draft_model": "/m", "speculation": SpeculationSetting.NGRAM}, "exllamav3_draft_model and speculation = ngram"),
    ({"cache_events": True}, "the exllamav3 engine publishes no cache events"),
])
def test_settings_exllamav3_cannot_run_with_fail_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(**settings)


def test_its_settings_have_names_of_their_own_beside_exllamav2s():
    loaded = load_config({"engine": "exllamav3", "exllamav3_cache_bits": "4", "exllamav3_cache_v_bits": "6",
                          "exllamav3_tensor_parallel": "true", "exllamav3_gpu_split": "20,24", "cache_tokens": "8192"},
                         environ={})
    own = loaded.engine.exllamav3
    assert (own.cache_bits, own.cache_v_bits, own.tensor_parallel, own.gpu_split) == (4, 6, True, (20.0, 24.0))
    assert own.cache_tokens == 0 and loaded.engine.exllamav2.cache_tokens == 8192  # cache_tokens is exllamav2's
    # In code, a name both sections have goes to the section of the engine built.
    assert config(cache_tokens=4096).exllamav3.cache_tokens == 4096
    assert EngineConfig.of(kind=EngineKind.EXLLAMAV2, cache_tokens=4096).exllamav2.cache_tokens == 4096


def folder(tmp_path, vocab_size: int = 64, name: str = "model"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size}))
    (directory / "tokenizer.json").write_text("{}")  # what find_model_dir asks of a folder (not read here)
    return directory


@pytest.mark.parametrize("cache_bits, draft", [(0, False), (4, True)])
def test_every_cache_is_built_before_its_model_loads(tmp_path, cache_bits, draft):
    settings = {"cache_bits": cache_bits, "gpu_split": (20.0,)} | (
        {"draft_model": str(folder(tmp_path, name="draft"))} if draft else {})
    engine = config(context_length=1024, max_batch_size=2, max_draft_tokens=4, **settings)
    sizes, drafts = generator_sizes(engine), speculation(engine, draft)
    loaded = load(fakes.classes(FakeGenerators(fakes.FakeGenerator)), folder(tmp_path), engine, sizes, drafts)
    caches = [loaded.cache, *([loaded.draft["draft_cache"]] if draft else [])]
    assert all(cache.initialized for cache in caches)  # else Generator.iterate asserts: never allocated
    assert loaded.cache.arguments["layer_type"] is (fakes.QuantLayer if cache_bits else fakes.Fp16Layer)
    assert loaded.cache.arguments["max_num_tokens"] == 2048 and loaded.cache.arguments["max_history"] == (4 if draft else 0)
    if cache_bits:
        assert (loaded.cache.arguments["k_bits"], loaded.cache.arguments["v_bits"]) == (4, 4)
    assert loaded.model.loaded_with == {"max_chunk_size": 1024, "max_batch_size": 2, "progressbar": False,
                                        "use_per_device": [20.0]}
    if draft:  # the draft model's cache has the main one's size, as Generator asserts
        assert loaded.draft["draft_cache"].max_num_tokens == loaded.cache.max_num_tokens


def test_tensor_parallel_loads_the_model_across_the_gpus(tmp_path):
    engine = config(tensor_parallel=True, tensor_parallel_backend=TensorParallelBackend.NCCL)
    loaded = load(fakes.classes(FakeGenerators(fakes.FakeGenerator)), folder(tmp_path), engine,
                  generator_sizes(engine), speculation(engine, False))
    assert loaded.model.loaded_with["tensor_p"] is True and loaded.model.loaded_with["tp_backend"] == "nccl"


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path):
    engine = config(draft_model=str(folder(tmp_path, vocab_size=32, name="draft")))
    with pytest.raises(EngineUnavailable, match="its vocabulary has 32 tokens, the model's 64"):
        load(fakes.classes(FakeGenerators(fakes.FakeGenerator)), folder(tmp_path), engine, generator_sizes(engine),
             speculation(engine, True))


def test_weights_exllamav3_cannot_load_are_refused_before_the_import(tmp_path):
    directory = folder(tmp_path)
    assert unloadable_weights(directory) == ""  # FP16 (no quantization)
    (directory / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3", "bits": 4}}))
    assert unloadable_weights(directory) == ""
    (directory / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert "cannot load GPTQ weights" in unloadable_weights(directory) and "engine = exllamav2" in unloadable_weights(directory)
    (directory / "config.json").write_text("{}")
    safetensors_with(directory / "model.safetensors", "model.layers.0.mlp.up_proj.q_weight")
    assert "cannot load EXL2 weights" in unloadable_weights(directory)


def test_a_failed_import_says_what_the_engine_needs():
    message = unavailable_message(ModuleNotFoundError("No module named 'triton'", name="triton"))
    assert "CUDA build of torch (with Triton)" in message and "No module named 'triton'" in message
    assert "tokenspout[exllamav3]" in message


def test_the_engine_module_imports_without_exllamav3():
    import importlib
    import sys

    importlib.import_module("backend.exllamav3.engine")
    assert "exllamav3" not in sys.modules  # only ExLlamaV3Engine() imports it (it compiles CUDA code)
