"""Every sampler the contract has, mapped to exllamav3 1.6.5's sampling steps or refused: the steps in llama.cpp's
order, nothing left to DefaultSampler's non-neutral defaults, and a job's sampler built from them by the binding
(over the step doubles, whose keywords and asserted values are 1.6.5's)."""

from __future__ import annotations

import math

import grpc
import pytest

from backend.exllama.sampling import sequence_breaker_ids
from backend.exllamav3.sampler import SUPPORTED_SAMPLERS, sampler_steps
from backend.types import (
    COMMON_SAMPLERS,
    DryParams,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    StopParams,
    XtcParams,
)
from service.errors import ServiceError
from service.validate import RequestValidator
from tests.harness.exllama_fakes import EOS, fake_core
from tokenspout.v1 import generation_pb2 as pb

PIECES = ["a", "b", "\n", "c:", "dd", '":', "e"]
TOKENIZER = object()


def steps(**sampling) -> list[tuple[str, dict]]:
    stopping = sampling.pop("stopping", StopParams())
    request = GenerationRequest("s", (1, 2, 3), SamplingParams(**sampling), stopping)
    return sampler_steps(request, EOS, lambda breakers: sequence_breaker_ids(PIECES, breakers), TOKENIZER)


def names(found: list[tuple[str, dict]]) -> list[str]:
    return [name for name, _ in found]


def test_greedy_takes_the_most_likely_token_after_the_penalties():
    assert steps(temperature=0.0) == [("SS_Argmax", {})]
    penalized = steps(temperature=0.0, repetition_penalty=1.2, penalty_last_n=32)
    assert names(penalized) == ["SS_RepP", "SS_PresFreqP", "SS_Argmax"]
    assert penalized[0][1] == {"rep_p": 1.2, "sustain_range": 32, "decay_range": 0}


def test_a_plain_draw_is_temperature_then_sample_and_nothing_else():
    # DefaultSampler (min_p 0.08, temperature 0.8) is never what a job gets.
    assert steps(temperature=0.7) == [("SS_Temperature", {"temperature": 0.7}), ("SS_Sample", {})]


def test_every_step_in_llama_cpps_order_with_the_requests_values():
    found = steps(
        temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
        frequency_penalty=0.1, penalty_last_n=64, logit_bias={5: 1.5},
        dry=DryParams(multiplier=0.8, base=2.0, allowed_length=3, last_n=128, sequence_breakers=("\n", ":")),
        xtc=XtcParams(probability=0.5, threshold=0.2),
    )
    assert names(found) == ["SS_LogitBias", "SS_RepP", "SS_PresFreqP", "SS_DRY", "SS_TopK", "SS_TopP", "SS_MinP",
                            "SS_XTC", "SS_Temperature", "SS_Sample"]
    arguments = dict(found)
    assert arguments["SS_LogitBias"] == {"logit_bias": {5: 1.5}}
    assert arguments["SS_PresFreqP"] == {"pres_p": 0.2, "freq_p": 0.1, "sustain_range": 64, "decay_range": 0}
    assert arguments["SS_DRY"] == {"dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3, "dry_range": 128,
                                   "dry_sequence_breakers": frozenset({2, 3, 5})}  # every token holding a breaker
    assert arguments["SS_XTC"] == {"probability": 0.5, "threshold": 0.2, "tokenizer": TOKENIZER}
    assert (arguments["SS_TopK"], arguments["SS_TopP"], arguments["SS_MinP"]) == (
        {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05})


def test_ignore_eos_bans_every_end_id_over_the_callers_own_bias():
    found = steps(logit_bias={2: 5.0, 7: 1.0}, stopping=StopParams(ignore_eos=True))
    assert found[0] == ("SS_LogitBias", {"logit_bias": {2: -math.inf, 7: 1.0}})


def test_penalties_without_a_window_or_a_value_are_left_out():
    assert "SS_RepP" not in names(steps(repetition_penalty=1.3, penalty_last_n=0))
    assert "SS_DRY" not in names(steps(dry=DryParams(multiplier=0.0)))
    assert "SS_XTC" not in names(steps(xtc=XtcParams(probability=0.0)))


def test_the_binding_builds_each_jobs_own_sampler_from_the_steps():
    core, generators = fake_core("exllamav3")
    request = GenerationRequest("a", (1, 2, 3), SamplingParams(temperature=0.5, top_k=5, seed=4), StopParams(8))
    core.add(request, lambda event: None)
    other = GenerationRequest("b", (1, 2, 3), SamplingParams(temperature=0.5, top_k=5, seed=4), StopParams(8))
    core.add(other, lambda event: None)
    first, second = generators[0].enqueued
    assert first.sampling.names == ["SS_TopK", "SS_Temperature", "SS_Sample"]
    assert first.sampling is not second.sampling  # one per job
    assert first.fields["seed"] == 4 and first.rng.random() == second.rng.random()


def test_a_value_a_step_would_assert_on_fails_only_that_request():
    """Validation keeps such values out; were one to slip through, 1.6.5 asserts while the job is built."""
    core, generators = fake_core("exllamav3")
    refused: list = []
    core.add(GenerationRequest("bad", (1, 2), SamplingParams(min_p=1.5), StopParams(4)), refused.append)
    assert "refused the job" in refused[0].message and not generators[0].enqueued


def info(samplers: tuple[str, ...]) -> ModelInfo:
    return ModelInfo("m", "exllamav3", 4096, 32000, 8, 1, EOS, False, samplers)


@pytest.mark.parametrize("field, sampling", [
    ("typical_p", pb.SamplingParams(typical_p=0.9)),
    ("mirostat", pb.SamplingParams(mirostat=pb.MirostatSampler(tau=5.0))),
    ("top_a", pb.SamplingParams(top_a=0.2)),
    ("tfs", pb.SamplingParams(tfs=0.9)),
    ("skew", pb.SamplingParams(skew=0.5)),
    ("smoothing_factor", pb.SamplingParams(smoothing_factor=0.3)),
])
def test_a_sampler_exllamav3_lacks_is_refused_naming_the_field(field, sampling):
    with pytest.raises(ServiceError) as refused:
        RequestValidator(info(SUPPORTED_SAMPLERS)).params(pb.GenerateStreamRequest(prompt="a", sampling=sampling))
    assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert [v.field for v in refused.value.violations] == [f"sampling.{field}"]


def test_every_other_sampler_of_the_contract_is_served():
    assert set(SUPPORTED_SAMPLERS) == set(COMMON_SAMPLERS) - {"typical_p", "mirostat"} | {"banned_strings", "token_healing"}
    sampling = pb.SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.1,
        frequency_penalty=0.1, penalty_last_n=32, seed=3, dry=pb.DrySampler(multiplier=0.5),
        xtc=pb.XtcSampler(probability=0.3, threshold=0.1), banned_strings=["x"], token_healing=True,
    )
    sampling.logit_bias[3] = 1.0
    params = RequestValidator(info(SUPPORTED_SAMPLERS)).params(pb.GenerateStreamRequest(prompt="a", sampling=sampling))
    assert params.sampling.in_effect() == set(SUPPORTED_SAMPLERS) - {"seed"}  # every one turned on, none refused
