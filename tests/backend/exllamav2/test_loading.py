"""Starting the exllamav2 engine, on CPU: the generator's sizes, the model-then-cache order, and what a
failed import says, each where exllamav2 0.3.2 would otherwise assert or misplace something on a GPU."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig, SpeculationSetting
from backend.exllamav2.loading import load_model_and_cache, unavailable_message
from backend.exllamav2.sizes import generator_fields, generator_sizes, speculation
from backend.types import SpeculationMode, SpeculationParams
from tests.harness.exllamav2_fakes import GENERATOR_PARAMETERS, FakeLibrary


def sizes(paged_attention: bool = True, no_flash_attn: bool = False, max_seq_len: int = 4096, max_chunk_size: int = 2048,
          **config):
    engine = EngineConfig.of(context_length=max_seq_len, **config)
    return generator_sizes(engine, paged_attention, no_flash_attn, max_chunk_size)


def test_the_prefill_chunk_is_always_a_whole_number_of_pages_within_the_context():
    assert sizes(max_seq_len=4096).chunk == 2048
    # 0.3.2 asserts a paged chunk is a multiple of 256, and load_autosplit cuts max_input_len to max_seq_len.
    assert sizes(max_seq_len=1000).chunk == 768
    assert sizes(max_seq_len=1000, max_chunk_size=300).chunk == 512
    assert sizes(max_seq_len=256).chunk == 256


def test_sizes_exllamav2_would_assert_on_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="context_length 128 is under exllamav2's 256-token page"):
        sizes(max_seq_len=128)
    # 8 tokens per sequence per step must fit in max_input_len (dynamic.py:366-370).
    with pytest.raises(ValueError, match="max_batch_size 64 needs a prefill chunk of at least 512 tokens.*to 32"):
        sizes(max_seq_len=256, max_batch_size=64)
    assert sizes(max_seq_len=256, max_batch_size=32).batch == 32
    assert sizes(paged_attention=False, max_seq_len=256, max_batch_size=64).batch == 1  # unpaged: one at a time


def test_paged_mode_follows_the_models_no_flash_attn():
    assert sizes().paged and sizes().batch == 8
    # arch_compat_overrides() turns flash-attn off for some models; paged mode would then assert at start.
    off = sizes(no_flash_attn=True)
    assert (off.paged, off.batch, off.cache_tokens) == (False, 1, 4096)
    assert not sizes(paged_attention=False).paged


def test_the_cache_is_a_whole_number_of_pages():
    assert sizes(max_seq_len=1000).cache_tokens == 8192  # 8 x 1000, rounded up to 256
    assert sizes(max_seq_len=1000, cache_tokens=3000).cache_tokens == 3072


@pytest.mark.parametrize("mode", list(SpeculationMode))
def test_the_generator_gets_only_keywords_0_3_2_has(mode):
    # ExLlamaV2DynamicGenerator takes **kwargs and ignores the ones it does not know.
    fields = generator_fields(sizes(), SpeculationParams(mode, 4))
    draft_model = {"draft_model", "draft_cache"} if mode is SpeculationMode.DRAFT_MODEL else set()
    assert set(fields) | {"model", "cache", "tokenizer"} | draft_model <= GENERATOR_PARAMETERS


@pytest.mark.parametrize("setting, draft_model, expected", [
    ("auto", False, (SpeculationMode.OFF, None)),
    ("off", False, (SpeculationMode.OFF, None)),
    ("ngram", False, (SpeculationMode.NGRAM, True)),
    ("auto", True, (SpeculationMode.DRAFT_MODEL, False)),
])
def test_the_generator_drafts_as_the_server_says(setting, draft_model, expected):
    config = EngineConfig(speculation=SpeculationSetting(setting), max_draft_tokens=16)
    drafts = speculation(config, draft_model)
    fields = generator_fields(sizes(), drafts)
    assert (drafts.mode, fields.get("use_ngram_draft")) == expected
    # It checks at most max_q_size (8) tokens of a job a step, drafts included: more would assert.
    assert fields.get("num_draft_tokens", 8) <= 8 and (drafts.mode is SpeculationMode.OFF) == ("num_draft_tokens" not in fields)


def test_a_draft_model_excludes_ngram_drafting():
    from backend.config import ExLlamaV2Settings

    with pytest.raises(ValueError, match="draft_model and speculation = ngram"):
        EngineConfig(speculation=SpeculationSetting.NGRAM, exllamav2=ExLlamaV2Settings(draft_model="/models/small"))


@pytest.mark.parametrize("gpu_split", [(), (20.0,), (20.0, 20.0)])
@pytest.mark.parametrize("cache_type", ["fp16", "q4", "q6", "q8"])
def test_every_cache_layer_lands_on_a_gpu(gpu_split, cache_type):
    model, cache = load_model_and_cache(FakeLibrary, object(), cache_type, 4096, gpu_split)
    assert cache.max_seq_len == 4096 and None not in cache.devices, cache.devices  # None: the CPU
    assert cache.devices == [model.cache_map[layer] for layer in range(model.layers)]


def test_a_flash_attn_that_fails_to_import_is_named_with_the_way_around_it():
    broken = ImportError("flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so: undefined symbol: _ZN3c10", name="flash_attn_2_cuda")
    assert "attention = sdpa" in unavailable_message(broken)
    namespace: dict = {}
    exec(compile("def load():\n    raise OSError('libcudart.so.12: cannot open shared object file')\n",
                 "/site-packages/flash_attn/__init__.py", "exec"), namespace)
    with pytest.raises(OSError) as raised:  # the failure inside flash_attn's own files, whatever it says
        namespace["load"]()
    assert "attention = sdpa" in unavailable_message(raised.value)
    missing = ModuleNotFoundError("No module named 'torch'", name="torch")
    message = unavailable_message(missing)
    assert "ModuleNotFoundError: No module named 'torch'" in message and "flash" not in message
