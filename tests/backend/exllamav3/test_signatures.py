"""Every keyword the engine gives exllamav3 (Generator, Job, Cache, Model.load, the filter's base, each sampling
step) is one 1.6.5 has, and every attribute, method and result key the engine reads is one 1.6.5 has.

The lists are pinned in tests/harness/exllamav3_fakes.py from 1.6.5's source. Where that source is on this
machine (exllamav3 installed, EXLLAMAV3_SOURCE naming a folder that holds the unpacked wheel or repository,
or tools/exllama_sources.sh having unpacked the wheel under ~/.cache/tokenspout/sources), they are checked
against it, read with `ast` (importing exllamav3 would compile its CUDA extension).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from backend.config import EngineConfig, EngineKind, SpeculationSetting
from backend.exllama.job_fields import job_fields
from backend.exllamav3.sampler import sampler_steps
from backend.exllamav3.sizes import cache_fields, generator_fields, generator_sizes, load_fields, speculation
from backend.types import DryParams, GenerationRequest, OutputParams, SamplingParams, StopParams, XtcParams
from tests.harness import exllamav3_fakes as fakes
from tests.harness.exllama_fakes import EOS, library_source

EVERYTHING = GenerationRequest(
    "everything", tuple(range(40)),
    SamplingParams(
        temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
        frequency_penalty=0.1, penalty_last_n=64, dry=DryParams(multiplier=0.8, last_n=32),
        xtc=XtcParams(probability=0.5), banned_strings=("x",), token_healing=True, logit_bias={5: 1.0},
    ),
    StopParams(max_new_tokens=8, min_new_tokens=2, stop_sequences=("\n",), ignore_eos=True),
    OutputParams(return_logprobs=True, top_logprobs=2),
)
REQUESTS = [GenerationRequest("greedy", (1, 2, 3), SamplingParams(temperature=0.0)), EVERYTHING]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.request_id)
def test_the_engine_gives_jobs_and_sampling_steps_only_what_1_6_5_takes(request_):
    assert set(job_fields(request_, EOS)) | {"input_ids", "sampler", "filters"} <= fakes.JOB_PARAMETERS
    for name, arguments in sampler_steps(request_, EOS, lambda breakers: frozenset(), object()):
        assert set(arguments) <= fakes.STEP_PARAMETERS[name], name


@pytest.mark.parametrize("setting", list(SpeculationSetting))
@pytest.mark.parametrize("cache_bits", [0, 4])
def test_the_generator_cache_and_loader_get_only_what_1_6_5_takes(setting, cache_bits):
    config = EngineConfig.of(kind=EngineKind.EXLLAMAV3, speculation=setting, cache_bits=cache_bits, gpu_split=(20.0,),
                             tensor_parallel=True)
    sizes, drafts = generator_sizes(config), speculation(config, False)
    assert set(generator_fields(sizes, drafts, config.exllamav3)) | {"model", "cache", "tokenizer"} <= \
        fakes.GENERATOR_PARAMETERS
    assert set(cache_fields(sizes, drafts, config.exllamav3)) | {"model", "layer_type"} <= \
        fakes.CACHE_PARAMETERS | fakes.QUANT_LAYER_PARAMETERS
    assert set(load_fields(sizes, config.exllamav3, tensor_parallel=True)) <= fakes.LOAD_PARAMETERS


@pytest.fixture(scope="module")
def source() -> pathlib.Path:
    found = library_source("exllamav3", "1.6.5")
    if found is None or not (found / "generator" / "generator.py").is_file():
        pytest.skip("exllamav3's source is not here (bash tools/exllama_sources.sh, or EXLLAMAV3_SOURCE)")
    assert '__version__ = "1.6.5"' in (found / "version.py").read_text()
    return found


def tree(source: pathlib.Path, path: str) -> ast.Module:
    return ast.parse((source / path).read_text())


def classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.walk(module) if isinstance(node, ast.ClassDef)}


def methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def parameters(function: ast.FunctionDef, skip_self: bool = True) -> set[str]:
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return {argument.arg for argument in arguments[1 if skip_self else 0:]}


def assigned(function: ast.FunctionDef) -> set[str]:
    """The attributes `self.x = ...` sets in a method."""
    return {target.attr for node in ast.walk(function) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)}


def test_the_pinned_keyword_lists_are_1_6_5s(source):
    generator = classes(tree(source, "generator/generator.py"))["Generator"]
    job = classes(tree(source, "generator/job.py"))["Job"]
    cache = classes(tree(source, "cache/cache.py"))["Cache"]
    quant = classes(tree(source, "cache/quant.py"))["CacheLayer_quant"]
    model = classes(tree(source, "model/model.py"))["Model"]
    base = classes(tree(source, "generator/filter/filter.py"))["Filter"]
    assert parameters(methods(generator)["__init__"]) == fakes.GENERATOR_PARAMETERS
    assert parameters(methods(job)["__init__"]) == fakes.JOB_PARAMETERS
    assert parameters(methods(cache)["__init__"]) == fakes.CACHE_PARAMETERS
    assert parameters(methods(quant)["__init__"]) - {"config", "attention", "cache_id", "max_num_tokens"} == \
        fakes.QUANT_LAYER_PARAMETERS
    assert parameters(methods(model)["load_gen"]) == fakes.LOAD_PARAMETERS
    assert parameters(methods(base)["__init__"]) == fakes.FILTER_PARAMETERS
    steps = classes(tree(source, "generator/sampler/custom.py"))
    for name, expected in fakes.STEP_PARAMETERS.items():
        init = methods(steps[name]).get("__init__")
        assert (parameters(init) if init else set()) == expected, name
    assert parameters(methods(steps["CustomSampler"])["__init__"]) == {"steps"}


def test_what_the_engine_reads_of_1_6_5_is_there(source):
    generator = methods(classes(tree(source, "generator/generator.py"))["Generator"])
    assert {"enqueue", "cancel", "iterate", "close"} <= set(generator)
    assert "pagetable" in assigned(generator["__init__"])
    page = classes(tree(source, "generator/pagetable.py"))["CachePage"]
    fields = {node.target.id for node in page.body if isinstance(node, ast.AnnAssign)}
    assert {"ref_count", "kv_position"} <= fields
    assert "all_pages" in assigned(methods(classes(tree(source, "generator/pagetable.py"))["PageTable"])["reset_page_table"])
    job = methods(classes(tree(source, "generator/job.py"))["Job"])
    # What preemption reads and carries over, and what the results come from.
    assert {"held_text", "held_tokens", "checkpoint", "rng", "sampler", "cached_pages", "cached_tokens",
            "accepted_draft_tokens", "rejected_draft_tokens", "identifier"} <= assigned(job["__init__"])
    base = methods(classes(tree(source, "generator/filter/filter.py"))["Filter"])
    assert {"reset", "accept_token", "get_next_logit_mask", "is_completed", "use_background_worker", "feed"} <= set(base)
    tokenizer = methods(classes(tree(source, "tokenizer/tokenizer.py"))["Tokenizer"])
    assert {"from_config", "get_id_to_piece_list"} <= set(tokenizer)
    assert {"eos_token_id", "bos_token_id"} <= assigned(tokenizer["__init__"])
    assert "from_directory" in methods(classes(tree(source, "model/config.py"))["Config"])
    assert "from_config" in methods(classes(tree(source, "model/model.py"))["Model"])


def test_a_failed_job_comes_back_as_its_own_error_result(source):
    """reap_failed_job's result: the keys the core reads (stage, job, error), and no identifier."""
    reap = methods(classes(tree(source, "generator/generator.py"))["Generator"])["reap_failed_job"]
    keys = {key.value for node in ast.walk(reap) if isinstance(node, ast.Dict) for key in node.keys
            if isinstance(key, ast.Constant)}
    assert {"job", "stage", "eos", "error"} <= keys and "identifier" not in keys
    assert any(isinstance(node, ast.Constant) and node.value == "error" for node in ast.walk(reap))


def test_the_exports_the_binding_imports_are_1_6_5s(source):
    init = (source / "__init__.py").read_text()
    for name in ("Config", "Model", "Tokenizer", "Cache", "CacheLayer_fp16", "CacheLayer_quant", "Generator", "Job",
                 "Filter"):
        assert name in init, name
    sampler_init = (source / "generator" / "sampler" / "__init__.py").read_text()
    for name in ("CustomSampler", *fakes.STEP_PARAMETERS):
        assert name in sampler_init, name
