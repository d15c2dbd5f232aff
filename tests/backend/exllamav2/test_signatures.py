"""Every keyword the engine gives exllamav2's sampler settings and jobs is one 0.3.2 has.

The lists are pinned in tests/harness/exllamav2_fakes.py from v0.3.2's source. Where that source is on
this machine (exllamav2 installed, EXLLAMAV2_SOURCE naming a folder that holds the unpacked
exllamav2-0.3.2 wheel or repository, or tools/exllama_sources.sh having unpacked the wheel under
~/.cache/tokenspout/sources), the pinned lists are checked against it, read with `ast` (importing
exllamav2 would compile its CUDA extension).
"""

from __future__ import annotations

import ast

import pytest

from backend.exllama.job_fields import job_fields
from backend.exllamav2.settings import settings_fields
from backend.types import (
    DryParams,
    GenerationRequest,
    MirostatParams,
    OutputParams,
    SamplingParams,
    StopParams,
    XtcParams,
)
from tests.harness.exllama_fakes import EOS, library_source
from tests.harness.exllamav2_fakes import GENERATOR_PARAMETERS, JOB_PARAMETERS, SETTINGS_FIELDS, no_breakers

REQUESTS = [
    GenerationRequest("greedy", (1, 2, 3), SamplingParams(temperature=0.0)),
    GenerationRequest(
        "everything", tuple(range(40)),
        SamplingParams(
            temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, typical_p=0.9, repetition_penalty=1.1, penalty_last_n=64,
            dry=DryParams(multiplier=0.8, last_n=32), xtc=XtcParams(probability=0.5), mirostat=MirostatParams(),
            top_a=0.1, tfs=0.9, skew=0.5, smoothing_factor=0.3, banned_strings=("x",), token_healing=True,
            logit_bias={5: 1.0},
        ),
        StopParams(max_new_tokens=8, min_new_tokens=2, stop_sequences=("\n",), ignore_eos=True),
        OutputParams(return_logprobs=True, top_logprobs=2),
    ),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.request_id)
def test_the_engine_sets_only_what_0_3_2_takes(request_):
    # The engine adds input_ids, gen_settings and filters to the job, and token_bias to the settings.
    assert set(settings_fields(request_, no_breakers)) | {"token_bias"} <= SETTINGS_FIELDS
    assert set(job_fields(request_, EOS)) | {"input_ids", "gen_settings", "filters"} <= JOB_PARAMETERS


def parameters(tree: ast.Module, class_name: str) -> set[str]:
    (init,) = [f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == class_name
               for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    return {argument.arg for argument in init.args.args[1:] + init.args.kwonlyargs}


def settings_dataclass_fields(tree: ast.Module) -> set[str]:
    (settings,) = [s for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "ExLlamaV2Sampler"
                   for s in c.body if isinstance(s, ast.ClassDef) and s.name == "Settings"]
    return {field.target.id for field in settings.body if isinstance(field, ast.AnnAssign)}


def test_the_pinned_lists_are_0_3_2s():
    source = library_source("exllamav2", "0.3.2")
    if source is None or not (source / "generator" / "dynamic.py").is_file():
        pytest.skip("exllamav2's source is not here (bash tools/exllama_sources.sh, or EXLLAMAV2_SOURCE)")
    assert '__version__ = "0.3.2"' in (source / "version.py").read_text()
    dynamic = ast.parse((source / "generator" / "dynamic.py").read_text())
    sampler = ast.parse((source / "generator" / "sampler.py").read_text())
    assert parameters(dynamic, "ExLlamaV2DynamicJob") == JOB_PARAMETERS
    assert parameters(dynamic, "ExLlamaV2DynamicGenerator") == GENERATOR_PARAMETERS
    assert settings_dataclass_fields(sampler) == SETTINGS_FIELDS
