"""exllamav2's own part on CPU: sampler settings with every non-neutral default overridden, DRY windows 0.3.2
accepts, the token bias tensor's width, weights it cannot load, the page budget and the samplers validation
lets through to it, and drafting a request cannot change. The shared core's tests are tests/backend/exllama/."""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest

from backend.exllama.job_fields import job_fields
from backend.exllama.sampling import sequence_breaker_ids, token_bias_values
from backend.exllamav2.settings import SUPPORTED_SAMPLERS, padded_logit_width, settings_fields
from backend.exllamav2.sizes import PAGE_SIZE
from backend.types import DryParams, GenerationRequest, MirostatParams, ModelInfo, SamplingParams, StopParams, XtcParams
from service.errors import ServiceError
from service.limits import Limits
from service.prompt import PromptBuilder
from service.validate import RequestParams, RequestValidator
from tests.harness.exllama_fakes import EOS, safetensors_with
from tokenspout.v1 import generation_pb2 as pb

PIECE_LIST = ["a", "b", "\n", "c:", "dd", '":', "e"]


def breaker_ids(breakers: tuple[str, ...]) -> set[int]:
    return sequence_breaker_ids(PIECE_LIST, breakers)


def sampled_job(prompt_tokens: int = 3, max_new_tokens: int = 16, **sampling) -> GenerationRequest:
    return GenerationRequest("s", tuple(range(prompt_tokens)), SamplingParams(**sampling), StopParams(max_new_tokens))


def test_sampler_settings_override_every_non_neutral_default():
    greedy = settings_fields(sampled_job(temperature=0.0), breaker_ids)
    assert greedy["top_k"] == 1 and greedy["temperature"] == 1.0 and greedy["token_repetition_penalty"] == 1.0
    sampled = settings_fields(
        sampled_job(temperature=0.7, top_k=0, top_p=1.0, repetition_penalty=1.1, penalty_last_n=64), breaker_ids
    )
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (0.7, 0, 0.0)
    assert (sampled["token_repetition_penalty"], sampled["token_repetition_range"]) == (1.1, 64)
    # exllamav2's own defaults (top_k 50, top_p 0.8, repetition 1.025, temperature 0.8) never leak through.
    assert sampled["dry_multiplier"] == 0.0 and sampled["xtc_probability"] == 0.0 and sampled["mirostat"] is False
    assert (sampled["top_a"], sampled["tfs"], sampled["skew"], sampled["smoothing_factor"]) == (0.0, 0.0, 0.0, 0.0)


def test_sampler_settings_carry_dry_xtc_mirostat_and_exllamav2s_own_samplers():
    request = sampled_job(
        temperature=0.9, dry=DryParams(multiplier=0.8, base=2.0, allowed_length=3, sequence_breakers=("\n", ":")),
        xtc=XtcParams(probability=0.5, threshold=0.2), mirostat=MirostatParams(tau=4.0, eta=0.2),
        top_a=0.1, tfs=0.95, skew=0.5, smoothing_factor=0.3,
    )
    fields = settings_fields(request, breaker_ids)
    assert (fields["dry_multiplier"], fields["dry_base"], fields["dry_allowed_length"]) == (0.8, 2.0, 3)
    assert fields["dry_sequence_breakers"] == {2, 3, 5}  # every token whose text holds a breaker
    assert (fields["dry_range"], fields["dry_max_ngram"]) == (0, 20)
    assert (fields["xtc_probability"], fields["xtc_threshold"]) == (0.5, 0.2)
    assert (fields["mirostat"], fields["mirostat_tau"], fields["mirostat_eta"]) == (True, 4.0, 0.2)
    assert (fields["top_a"], fields["tfs"], fields["skew"], fields["smoothing_factor"]) == (0.1, 0.95, 0.5, 0.3)


@pytest.mark.parametrize("last_n", [2, 3, 20, 21, 64, 4096])
@pytest.mark.parametrize("allowed_length", [1, 2, 19, 20, 64])
def test_a_dry_window_always_outlasts_the_longest_tracked_repeat(last_n, allowed_length):
    dry = DryParams(multiplier=1.0, last_n=last_n, allowed_length=allowed_length)
    fields = settings_fields(sampled_job(prompt_tokens=100, max_new_tokens=4096, dry=dry), breaker_ids)
    # exllamav2 asserts the first; it only penalizes repeats shorter than dry_max_ngram (the second).
    assert fields["dry_range"] > fields["dry_max_ngram"] > allowed_length
    assert fields["dry_range"] == max(last_n, fields["dry_max_ngram"] + 1)


def test_a_dry_window_falls_back_to_the_whole_job_where_exllamav2_would_fail_or_it_changes_nothing():
    dry = DryParams(multiplier=1.0, last_n=64)
    assert settings_fields(sampled_job(prompt_tokens=1, dry=dry), breaker_ids)["dry_range"] == 0  # 0.3.2 fails
    healed_two = sampled_job(prompt_tokens=2, dry=dry, token_healing=True)
    assert settings_fields(healed_two, breaker_ids)["dry_range"] == 0
    assert settings_fields(sampled_job(prompt_tokens=10, max_new_tokens=54, dry=dry), breaker_ids)["dry_range"] == 0
    assert settings_fields(sampled_job(prompt_tokens=10, max_new_tokens=55, dry=dry), breaker_ids)["dry_range"] == 64


def test_ignore_eos_biases_every_end_id_to_minus_infinity():
    biased = SamplingParams(logit_bias={2: 5.0, 7: 1.5})
    ignoring = GenerationRequest("r", (1,), biased, StopParams(ignore_eos=True))
    assert token_bias_values(ignoring, (2, 9)) == {2: -math.inf, 9: -math.inf, 7: 1.5}  # over the caller's own bias
    assert job_fields(ignoring, (2, 9))["stop_conditions"] == []
    assert token_bias_values(GenerationRequest("r", (1,), biased), (2, 9)) == {2: 5.0, 7: 1.5}
    assert token_bias_values(GenerationRequest("r", (1,)), (2, 9)) == {}  # no tensor at all


def test_token_bias_is_padded_to_the_logit_width():
    assert [padded_logit_width(v) for v in (32000, 32001, 49152, 151936)] == [32000, 32032, 49152, 151936]


def test_the_engine_module_imports_without_exllamav2():
    import importlib
    import sys

    importlib.import_module("backend.exllamav2.engine")
    assert "exllamav2" not in sys.modules  # only ExLlamaV2Engine() imports it (it compiles CUDA code)
    assert importlib.import_module("backend.exllamav2.sizes").PAGE_SIZE == 256



def test_gptq_other_than_4_bit_is_refused_before_loading(tmp_path):
    import json

    from backend.exllamav2.loading import unloadable_weights

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    # 4-bit: 512 inputs x 512 outputs, 8 values to an int32; 4 groups of 128.
    safetensors_with(tmp_path / "model.safetensors", up__qweight=[64, 512], up__qzeros=[4, 64], up__scales=[4, 512])
    assert unloadable_weights(tmp_path) == ""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 8}}))
    assert "only 4-bit GPTQ weights; this model's config.json says 8-bit" in unloadable_weights(tmp_path)
    # 8-bit tensors, whatever the config says: the extension's own check (ext_qmatrix.cpp:66) would fail on the GPU.
    (tmp_path / "config.json").write_text("{}")
    safetensors_with(tmp_path / "model.safetensors", up__qweight=[128, 512], up__qzeros=[4, 128], up__scales=[4, 512])
    assert "up.qweight is not packed 8 to an int32" in unloadable_weights(tmp_path)
    safetensors_with(tmp_path / "model.safetensors", "model.layers.0.mlp.up_proj.q_weight")  # EXL2: not GPTQ's business
    assert unloadable_weights(tmp_path) == ""


def paged_info(cache_tokens: int, samplers: tuple[str, ...] = SUPPORTED_SAMPLERS) -> ModelInfo:
    return ModelInfo("m", "exllamav2", 4096, 32000, 8, 1, EOS, False, samplers, cache_tokens=cache_tokens,
                     cache_page_tokens=PAGE_SIZE)


def test_the_page_budget_is_checked_before_enqueue():
    assert paged_info(256).budget_problem(100, 156) == ""
    assert "context" in paged_info(65536).budget_problem(4000, 200)
    assert "2 cache pages; the cache has 1" in paged_info(256).budget_problem(100, 157)


class PagedEngine:
    """Just what validation reads of an exllamav2 engine."""

    def __init__(self, samplers: tuple[str, ...] = SUPPORTED_SAMPLERS) -> None:
        self.info = paged_info(512, samplers)

    def tokenize(self, text, add_special=True):
        return list(range(len(text.split())))


def checked(engine: PagedEngine, request: pb.GenerateStreamRequest) -> RequestParams:
    """A request's settings as a call builds them: its fields checked, then its prompt (and the page budget)."""
    params = RequestValidator(engine.info).params(request)
    PromptBuilder(engine, Limits().max_input_bytes).prompt(request, params.stopping.max_new_tokens)
    return params


def test_a_request_over_the_budget_is_out_of_range_before_it_reaches_the_engine():
    engine = PagedEngine()
    fits = pb.GenerateStreamRequest(prompt="a b c", stopping=pb.StoppingCriteria(max_new_tokens=500))
    assert checked(engine, fits).stopping.max_new_tokens == 500
    too_big = pb.GenerateStreamRequest(prompt="a b c", stopping=pb.StoppingCriteria(max_new_tokens=1000))
    with pytest.raises(ServiceError) as refused:
        checked(engine, too_big)
    assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE and "cache pages" in refused.value.message


def test_exllamav2s_own_samplers_pass_validation_where_the_engine_has_them():
    request = pb.GenerateStreamRequest(
        prompt="a b c",
        sampling=pb.SamplingParams(
            top_a=0.25, skew=1.0, banned_strings=["As an AI"], token_healing=True, dry=pb.DrySampler(multiplier=0.8)
        ),
    )
    request.sampling.logit_bias[5] = -100.0
    sampling = checked(PagedEngine(), request).sampling
    assert (sampling.top_a, sampling.skew, sampling.banned_strings, sampling.token_healing) == (0.25, 1.0, ("As an AI",), True)
    assert sampling.dry.multiplier == pytest.approx(0.8) and sampling.logit_bias == {5: -100.0}
    with pytest.raises(ServiceError) as refused:  # the same request, to an engine with only the basics
        checked(PagedEngine(("temperature", "seed")), request)
    assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert {v.field for v in refused.value.violations} == {
        f"sampling.{name}" for name in ("top_a", "skew", "banned_strings", "token_healing", "dry", "logit_bias")
    }


def test_a_request_may_not_change_how_the_exllamav2_generator_drafts():
    from backend.types import SpeculationMode, SpeculationParams

    engine = PagedEngine()
    drafts = SpeculationParams(SpeculationMode.NGRAM, 4)
    engine.info = dataclasses.replace(engine.info, speculation_modes=(SpeculationMode.NGRAM,),
                                      default_speculation=drafts, draft_tokens_per_request=False)
    assert checked(engine, pb.GenerateStreamRequest(prompt="a b")).speculation == drafts
    for asked in (pb.Speculation(mode=pb.SPECULATION_MODE_OFF), pb.Speculation(max_draft_tokens=2)):
        with pytest.raises(ServiceError) as refused:
            checked(engine, pb.GenerateStreamRequest(prompt="a b", speculation=asked))
        assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert {v.field for v in refused.value.violations} & {"speculation.mode", "speculation.max_draft_tokens"}
