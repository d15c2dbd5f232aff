"""The exllamav2 engine's CPU side, against a fake generator that behaves like 0.3.2 (tests/harness/exllamav2_fakes.py).

exllamav2 itself needs CUDA to import, so these tests drive the owner-thread core
through the generator's queue API (enqueue / cancel / iterate) as 0.3.2's source has
it: results without text, several per iterate, held text released with its ids later,
a stop-token EOS whose tokens are only in `held`, an assertion from enqueue, a cancel
that emits nothing, an exception from iterate, the page table behind the cache figures.
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest

from backend.events import ErrorEvent, FinishReason
from backend.exllamav2.core import ExLlamaV2Core
from backend.exllamav2.jobs import job_fields
from backend.exllamav2.settings import (
    SUPPORTED_SAMPLERS,
    padded_logit_width,
    sequence_breaker_ids,
    settings_fields,
    token_bias_values,
)
from backend.exllamav2.sizes import PAGE_SIZE
from backend.types import (
    DryParams,
    GenerationRequest,
    MirostatParams,
    ModelInfo,
    OutputParams,
    SamplingParams,
    StopParams,
    XtcParams,
)
from service.errors import ServiceError
from service.limits import Limits
from service.prompt import PromptBuilder
from service.validate import RequestParams, RequestValidator
from tests.harness.core_driver import Delivering
from tests.harness.exllamav2_fakes import EOS, FakeGenerators, FakeJobs, eos, streaming
from tokenspout.v1 import generation_pb2 as pb

PIECES = {10: b"Hel", 11: b"lo", 12: b" wor", 13: b"ld", 2: b""}


def request(request_id: str, prompt: tuple[int, ...] = (1, 5, 6), output: OutputParams = OutputParams(),
            **stopping) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(temperature=0.0),
                             StopParams(**({"max_new_tokens": 16} | stopping)), output)


@pytest.fixture
def setup():
    generators = FakeGenerators()
    core = Delivering(
        ExLlamaV2Core(generators, FakeJobs(), EOS, lambda t: PIECES.get(t, b"?"), vocab_size=16, cache_tokens=4096)
    )
    return core, generators


def collect(events: list):
    return lambda event: events.append(event)


def run(core, generator, request_id: str, samples: list[tuple]) -> None:
    """Lets the fake generator sample these tokens for the job, to its end."""
    generator.samples[request_id] = list(samples)
    while core.has_work():
        core.step()


def delivered(events: list) -> list[int]:
    return [t.token_id for e in events for t in e.tokens]


def test_results_without_text_and_several_per_iterate(setup):
    core, generators = setup
    events: list = []
    core.add(request("a"), collect(events))
    generators[0].script = [
        [{"job": None, "stage": "started", "eos": False, "serial": 1, "identifier": "a"},
         {"job": None, "stage": "prefill", "eos": False, "serial": 1, "identifier": "a", "curr_progress": 3, "max_progress": 3}],
        [streaming("a"), streaming("a", [10, 11], "Hello")],  # a token held (no text, no id), then both released
        [streaming("a", [12, 13], " world")],
        [eos("a", "max_new_tokens", 4, text="")],
    ]
    while core.has_work():
        core.step()
    assert "".join(e.text for e in events) == "Hello world"
    assert [t.token_id for e in events for t in e.tokens] == [10, 11, 12, 13]
    finish = events[-1].finish
    assert finish.reason is FinishReason.MAX_TOKENS and finish.usage.completion_tokens == 4
    assert finish.timings.time_to_first_token_s == pytest.approx(0.03) and finish.timings.decode_s == pytest.approx(0.3)


def test_a_stop_token_eos_delivers_the_held_tokens_and_the_stop_token(setup):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("Hello!",)), collect(events))
    # "Hel" and "lo" are held (they could become "Hello!"); 0.3.2 emits the EOS without them.
    run(core, generators[0], "a", [(10, b"Hel"), (11, b"lo"), (2, b"")])
    assert "".join(e.text for e in events) == "Hello"
    assert delivered(events) == [10, 11, 2]
    finish = events[-1].finish
    assert finish.reason is FinishReason.EOS_TOKEN and finish.usage.completion_tokens == events[-1].generated_tokens == 3


def test_a_stop_token_keeps_the_held_text_but_not_its_own(setup):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("Hello!",), stop_token_ids=frozenset({13})), collect(events))
    run(core, generators[0], "a", [(10, b"Hel"), (11, b"lo"), (13, b"ld")])
    assert "".join(e.text for e in events) == "Hello" and delivered(events) == [10, 11, 13]
    assert events[-1].finish.reason is FinishReason.STOP_TOKEN and events[-1].finish.stop_token_id == 13


def test_held_tokens_get_their_logprobs_from_the_held_logits(setup):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("Help",), output=OutputParams(return_logprobs=True)), collect(events))
    first, last = [-math.inf] * 16, [-math.inf] * 16
    first[10], first[12], last[2] = math.log(0.25), math.log(0.75), 0.0
    run(core, generators[0], "a", [(10, b"Hel", first), (2, b"", last)])
    assert [(t.token_id, t.logprob) for e in events for t in e.tokens] == [(10, pytest.approx(math.log(0.25))), (2, 0.0)]


@pytest.mark.parametrize("include, text", [(False, "Hel"), (True, "Hello w")])
def test_a_stop_sequence_is_cut_unless_included(setup, include, text):
    core, generators = setup
    events: list = []
    core.add(request("a", stop_sequences=("lo w",), include_stop_sequence=include), collect(events))
    run(core, generators[0], "a", [(10, b"Hel"), (11, b"lo"), (12, b" wor")])
    assert "".join(e.text for e in events) == text and delivered(events) == [10, 11, 12]
    assert events[-1].finish.reason is FinishReason.STOP_SEQUENCE and events[-1].finish.stop_sequence == "lo w"


def test_logprobs_and_alternatives_come_from_the_steps_logits(setup):
    core, generators = setup
    events: list = []
    wants = GenerationRequest("a", (1, 5, 6), SamplingParams(temperature=0.0), StopParams(16),
                              OutputParams(return_logprobs=True, top_logprobs=2))
    assert job_fields(wants, EOS)["return_logits"] and not job_fields(wants, EOS)["return_probs"]
    core.add(wants, collect(events))
    step = [-math.inf] * 20  # padded past the 16-token vocabulary; the padding must not count
    first, second = list(step), list(step)
    first[10], first[12], first[13], first[18] = math.log(0.5), math.log(0.3), math.log(0.2), 99.0
    second[11], second[13], second[19] = 0.0, -math.inf, 99.0
    generators[0].script = [[streaming("a", [10, 11], "Hello", logits=[[first, second]])]]
    core.step()
    tokens = events[0].tokens
    assert [t.logprob for t in tokens] == pytest.approx([math.log(0.5), 0.0])
    assert [(top.token_id, top.piece) for top in tokens[0].top_logprobs] == [(10, b"Hel"), (12, b" wor")]
    assert tokens[0].top_logprobs[1].logprob == pytest.approx(math.log(0.3))
    assert tokens[1].top_logprobs[0].token_id == 11


def test_an_enqueue_assertion_fails_only_that_request(setup):
    core, generators = setup
    events: list = []
    core.add(request("big", max_new_tokens=5000), collect(events))  # 20 pages; the cache has 16
    assert isinstance(events[0], ErrorEvent) and "cannot be enqueued" in events[0].message
    assert not core.has_work()


def test_cancel_between_iterates_frees_the_job_and_drops_late_results(setup):
    core, generators = setup
    events: list = []
    core.add(request("a"), collect(events))
    generators[0].script = [[streaming("a", [10], "Hel")], [streaming("a", [11], "lo")]]
    core.step()
    core.cancel("a")
    assert generators[0].cancelled == generators[0].enqueued
    assert events[-1].finish.reason is FinishReason.CANCELLED and events[-1].finish.usage.completion_tokens == 1
    core.step()  # the script still holds a result for "a": dropped
    assert len(events) == 2 and not core.has_work() and core.stats.cancelled_total == 1


def test_a_banned_strings_rewind_drops_the_suppressed_tokens(setup):
    core, generators = setup
    events: list = []
    banned = GenerationRequest("b", (1, 5, 6), SamplingParams(temperature=0.0, banned_strings=("lo",)), StopParams(16))
    core.add(banned, collect(events))
    generators[0].script = [
        # As 0.3.2 emits it: the text is rewound, the token ids still hold the suppressed token.
        [streaming("b", [10, 11], "Hel", suppressed_text="lo", suppressed_tokens=[[11]])],
        [eos("b", "max_new_tokens", 2, token_ids=[[12]], text=" wor")],
    ]
    core.step()
    core.step()
    assert [t.token_id for e in events for t in e.tokens] == [10, 12]
    assert [e.generated_tokens for e in events] == [1, 2] and events[-1].finish.usage.completion_tokens == 2


def test_a_healed_job_counts_its_regenerated_token_within_max_new_tokens(setup):
    core, generators = setup
    healed = GenerationRequest(
        "h", (1, 5, 6), SamplingParams(temperature=0.0, token_healing=True), StopParams(max_new_tokens=3, min_new_tokens=1)
    )
    fields = job_fields(healed, EOS)
    assert (fields["max_new_tokens"], fields["min_new_tokens"], fields["token_healing"]) == (2, 0, True)
    events: list = []
    core.add(healed, collect(events))
    # exllamav2 counts a healed job from -1, so its own new_tokens ends one short of the tokens it emitted.
    run(core, generators[0], "h", [(13, b"ld"), (10, b"Hel"), (11, b"lo")])
    assert len(delivered(events)) == 3 and events[-1].finish.usage.completion_tokens == 3


def test_a_one_token_prompt_is_not_healed(setup):
    core, generators = setup
    one = GenerationRequest("h", (5,), SamplingParams(temperature=0.0, token_healing=True), StopParams(max_new_tokens=3))
    fields = job_fields(one, EOS)
    assert (fields["max_new_tokens"], fields["token_healing"]) == (3, False)  # 0.3.2 heals only longer prompts
    events: list = []
    core.add(one, collect(events))
    run(core, generators[0], "h", [(10, b"Hel"), (11, b"lo"), (12, b" wor")])
    assert delivered(events) == [10, 11, 12] and events[-1].finish.usage.completion_tokens == 3


def test_a_job_that_cannot_be_built_fails_alone(setup):
    core, generators = setup
    failed: list = []
    core.add(request("explode"), collect(failed))
    assert isinstance(failed[0], ErrorEvent) and "unexpected keyword" in failed[0].message
    later: list = []
    core.add(request("b"), collect(later))
    generators[0].script = [[eos("b", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    assert later[-1].finish.reason is FinishReason.MAX_TOKENS


def test_a_failed_rebuild_fails_new_requests_until_one_succeeds(setup):
    core, generators = setup
    core.add(request("a"), collect([]))
    generators[0].explode = True
    generators.failing = True
    core.step()  # iterate() fails, and so does the rebuild
    refused: list = []
    core.add(request("b"), collect(refused))
    assert isinstance(refused[0], ErrorEvent) and "could not be rebuilt" in refused[0].message
    generators.failing = False
    served: list = []
    core.add(request("c"), collect(served))  # rebuilds first
    generators[-1].script = [[eos("c", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    assert len(generators) == 2 and served[-1].finish.reason is FinishReason.MAX_TOKENS


def test_a_paused_job_runs_on_and_loses_nothing(setup):
    core, generators = setup
    events: list = []
    core.add(request("a"), collect(events))
    generators[0].script = [[streaming("a", [10], "Hel")], [eos("a", "max_new_tokens", 2, token_ids=[[11]], text="lo")]]
    core.pause("a")  # the slow-reader signal: exllamav2 cannot hold one job back
    core.step()
    core.step()
    assert "".join(e.text for e in events) == "Hello" and events[-1].finish.reason is FinishReason.MAX_TOKENS
    assert not generators[0].cancelled and not core.has_work()


def test_cancel_of_a_pending_job_and_after_eos(setup):
    core, generators = setup
    events: list = []
    core.add(request("pending"), collect(events))
    core.cancel("pending")  # never iterated: still cancelled in the generator
    assert [j.identifier for j in generators[0].cancelled] == ["pending"]
    core.add(request("done"), collect(events))
    generators[0].script = [[eos("done", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    core.cancel("done")  # after EOS: a no-op
    assert [j.identifier for j in generators[0].cancelled] == ["pending"]
    assert [e.finish.reason for e in events] == [FinishReason.CANCELLED, FinishReason.MAX_TOKENS]


def test_an_exception_from_iterate_fails_the_streams_and_rebuilds_the_generator(setup):
    core, generators = setup
    first: list = []
    second: list = []
    core.add(request("a"), collect(first))
    core.add(request("b"), collect(second))
    generators[0].explode = True
    core.step()
    assert all(isinstance(events[-1], ErrorEvent) for events in (first, second))
    assert len(generators) == 2 and not core.has_work()
    for pool in (generators[0].sampling_pool, generators[0].filter_pool):  # the old one's 2 x 16 threads go
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(int)
    assert generators[1].filter_pool.submit(int).result() == 0
    later: list = []
    core.add(request("c"), collect(later))
    generators[1].script = [[eos("c", "max_new_tokens", 1, token_ids=[[10]], text="Hel")]]
    core.step()
    assert later[-1].finish.reason is FinishReason.MAX_TOKENS  # the engine keeps serving


def test_job_fields_are_explicit():
    req = GenerationRequest(
        "r1", (1, 2), SamplingParams(temperature=0.7, top_p=0.9, seed=5),
        StopParams(max_new_tokens=40, min_new_tokens=2, stop_sequences=("\n\n",), stop_token_ids=frozenset({7})),
        OutputParams(return_logprobs=True, top_logprobs=3),
    )
    assert job_fields(req, EOS) == {
        "max_new_tokens": 40, "min_new_tokens": 2, "seed": 5, "stop_conditions": ["\n\n", 2, 7],
        "decode_special_tokens": False, "return_probs": False, "return_top_tokens": 0, "return_logits": True,
        "token_healing": False, "banned_strings": None, "identifier": "r1",
    }
    healing = GenerationRequest("r3", (1, 2), SamplingParams(banned_strings=("As an AI",), token_healing=True))
    assert job_fields(healing, EOS)["banned_strings"] == ["As an AI"] and job_fields(healing, EOS)["token_healing"]
    ignoring = GenerationRequest("r2", (1,), stopping=StopParams(ignore_eos=True))
    assert job_fields(ignoring, EOS)["stop_conditions"] == []


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


def test_every_end_id_of_config_generation_config_and_tokenizer_is_kept(tmp_path):
    import json

    from backend.exllamav2.model_files import end_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert end_token_ids(tmp_path, None) == (2, 7)  # no generation_config.json; a list in config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert end_token_ids(tmp_path, 1) == (1, 2, 7, 9)
    (tmp_path / "config.json").write_text(json.dumps({}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert end_token_ids(tmp_path, 5) == (5,)


def safetensors_with(path, *names: str, **shapes: list[int]) -> None:
    """A safetensors file's header (names, or name=shape with dots as double underscores), data omitted."""
    import json
    import struct

    tensors = dict.fromkeys(names, [1]) | {name.replace("__", "."): shape for name, shape in shapes.items()}
    header = json.dumps({name: {"dtype": "I32", "shape": shape, "data_offsets": [0, 2]} for name, shape in tensors.items()})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0\0")


def test_the_weight_format_comes_from_the_config_or_the_tensor_names(tmp_path):
    import json

    from backend.exllamav2.model_files import weight_format

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl2", "bits": 4.0}}))
    assert weight_format(tmp_path) == "EXL2 4.0 bpw"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert weight_format(tmp_path) == "GPTQ 4-bit"
    (tmp_path / "config.json").write_text("{}")
    safetensors_with(tmp_path / "model.safetensors", "model.layers.0.mlp.up_proj.weight")
    assert weight_format(tmp_path) == "FP16"
    safetensors_with(tmp_path / "model-2.safetensors", "model.layers.0.mlp.up_proj.qweight")
    assert weight_format(tmp_path) == "GPTQ"
    safetensors_with(tmp_path / "model-2.safetensors", "model.layers.0.mlp.up_proj.q_weight")
    assert weight_format(tmp_path) == "EXL2"


def test_gptq_other_than_4_bit_is_refused_before_loading(tmp_path):
    import json

    from backend.exllamav2.model_files import unloadable_weights

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


def test_bos_follows_the_tokenizer_config_else_the_post_processor(tmp_path):
    import json

    from backend.exllamav2.model_files import adds_bos

    assert adds_bos(tmp_path, "<s>") is False  # nothing says so
    llama3 = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>"}}, {"Sequence": {"id": "A"}}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"post_processor": {"type": "Sequence", "processors": [
        {"type": "ByteLevel"}, llama3]}}))
    assert adds_bos(tmp_path, "<|begin_of_text|>") is True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert adds_bos(tmp_path, "<|begin_of_text|>") is False  # the config's word wins


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


def test_the_same_engine_stats_as_the_llama_cpp_core(setup):
    import time

    from backend.worker import CancelOrder

    core, generators = setup
    finished: list = []
    cancelled: list = []
    core.add(request("a"), collect(finished))
    core.add(request("b"), collect(cancelled))
    assert core.stats.queued_requests == 2 and core.stats.running_sequences == 0
    generators[0].script = [
        [{"job": None, "stage": "started", "eos": False, "serial": 1, "identifier": "a"}],
        [{**eos("a", "max_new_tokens", 1), "cached_tokens": 2}],
    ]
    core.step()
    stats = core.stats
    assert (stats.started_total, stats.running_sequences, stats.queued_requests, stats.prompt_tokens_total) == (1, 1, 1, 3)
    core.step()
    # The generator's own prefix reuse (deduplicated pages) is the request's cached_tokens and the server's hit rate.
    assert finished[-1].finish.usage.cached_tokens == 2 and core.stats.cached_prompt_tokens_total == 2
    assert core.stats.prefix_hit_rate == pytest.approx(2 / 3)
    core.cancel(CancelOrder("b", time.monotonic(), core.steps - 2))
    assert core.stats.max_cancel_latency_steps == 2 and core.stats.running_sequences == core.stats.queued_requests == 0
    finish = cancelled[-1].finish  # built through the same path as every other Finish, with real timings
    assert finish.reason is FinishReason.CANCELLED and finish.usage.prompt_tokens == 3
    assert 0 <= finish.timings.queue_s <= finish.timings.total_s and finish.seed == 0


def test_the_cache_figures_come_from_the_page_table(setup):
    core, generators = setup
    events: list = []
    core.add(request("long", prompt=tuple(range(300)), max_new_tokens=4), collect(events))
    assert (core.stats.prefix_cache_entries, core.stats.prefix_cache_tokens) == (0, 0)  # 16 free pages, none used yet
    generators[0].samples["long"] = [(10, b"Hel"), (11, b"lo")]
    core.step()
    # 304 tokens reserve two whole pages up front, whatever the job has generated so far.
    assert core.stats.cache_tokens_used == 512 and core.stats.cache_tokens_total == 4096
    assert core.stats.prefix_cache_entries == 0
    core.cancel("long")
    # Its pages are free again, and still hold its 300 prompt tokens for a later prompt.
    stats = core.stats
    assert (stats.cache_tokens_used, stats.prefix_cache_entries, stats.prefix_cache_tokens) == (0, 2, 300)


def test_closing_stops_the_generators_threads(setup):
    core, generators = setup
    core.close()
    with pytest.raises(RuntimeError, match="after shutdown"):
        generators[0].sampling_pool.submit(int)


def test_the_generators_draft_counts_are_the_requests_usage_and_the_servers_totals(setup):
    core, generators = setup
    finished: list = []
    core.add(request("a"), collect(finished))
    generators[0].script = [
        [{"job": None, "stage": "started", "eos": False, "serial": 1, "identifier": "a"}],
        [{**eos("a", "max_new_tokens", 1), "accepted_draft_tokens": 5, "rejected_draft_tokens": 3}],
    ]
    core.step()
    core.step()
    usage = finished[-1].finish.usage
    assert (usage.draft_tokens, usage.accepted_draft_tokens) == (8, 5)
    assert (core.stats.draft_tokens_total, core.stats.accepted_draft_tokens_total) == (8, 5)


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
