"""The samplers beyond the basics: DRY, XTC and mirostat on the real model, and the
exllamav2-only ones refused with UNIMPLEMENTED (validation, on the fake engine, which has the same
samplers as the llama.cpp engine: COMMON_SAMPLERS)."""

from __future__ import annotations

import grpc
import pytest

from backend.exllamav2.settings import EXLLAMAV2_ONLY_SAMPLERS
from backend.types import COMMON_SAMPLERS, DryParams, MirostatParams, SamplingParams, XtcParams
from tests.harness.helpers import bad_request_fields, error_reason, greedy, rpc_error, stream, token_ids_of
from tokenspout.v1 import generation_pb2 as pb

REPETITIVE = "The cat sat on the mat. The cat sat on the mat. The cat"
STORY = "Once upon a time"


def longest_repeat(ids: list[int]) -> int:
    """The length of the longest token n-gram that occurs at least twice."""
    n = 0
    while any(ids[i : i + n + 1] in (ids[j : j + n + 1] for j in range(i)) for i in range(1, len(ids) - n)):
        n += 1
    return n


def sampled(prompt: str, **sampling) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=1.0, seed=7, **sampling),
        stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True),
        output=pb.OutputOptions(return_token_ids=True),
    )


def test_longest_repeat():
    assert longest_repeat([1, 2, 3, 4]) == 0
    assert longest_repeat([1, 2, 3, 9, 1, 2, 3]) == 3


def test_dry_breaks_repetition(stub):
    plain = greedy(REPETITIVE, max_new_tokens=100, ignore_eos=True)
    dry = greedy(REPETITIVE, max_new_tokens=100, ignore_eos=True)
    dry.sampling.dry.multiplier = 0.8
    plain_ids, dry_ids = token_ids_of(stream(stub, plain)), token_ids_of(stream(stub, dry))
    assert longest_repeat(plain_ids) >= 8  # greedy decoding of this model loops
    assert longest_repeat(dry_ids) < longest_repeat(plain_ids) / 2


def test_a_sampler_configured_but_off_asks_nothing_of_the_engine():
    off = SamplingParams(dry=DryParams(base=3.0), xtc=XtcParams(threshold=0.3), top_a=0.0, tfs=1.0)
    assert off.in_effect() == set()
    on = SamplingParams(dry=DryParams(multiplier=0.5), xtc=XtcParams(probability=0.1), mirostat=MirostatParams())
    assert on.in_effect() == {"dry", "xtc", "mirostat"}


def test_xtc_changes_a_seeded_draw_and_replays(stub):
    plain = token_ids_of(stream(stub, sampled(STORY)))
    xtc = sampled(STORY, xtc=pb.XtcSampler(probability=1.0, threshold=0.1))
    first, second = token_ids_of(stream(stub, xtc)), token_ids_of(stream(stub, xtc))
    assert first == second and first != plain


def test_mirostat_replaces_the_draw_and_replays(stub):
    plain = token_ids_of(stream(stub, sampled(STORY)))
    mirostat = sampled(STORY, mirostat=pb.MirostatSampler(tau=3.0))
    first, second = token_ids_of(stream(stub, mirostat)), token_ids_of(stream(stub, mirostat))
    assert first == second and first != plain


def test_model_info_names_the_samplers_the_engine_has(stub):
    samplers = set(stub.GetModelInfo(pb.GetModelInfoRequest()).samplers)
    assert {"dry", "xtc", "mirostat", "logit_bias", "min_p", "typical_p"} <= samplers
    assert set(COMMON_SAMPLERS) == samplers and not set(EXLLAMAV2_ONLY_SAMPLERS) & samplers
    # Every SamplingParams field is either common or exllamav2's own, and the proto has each one.
    assert set(SamplingParams.__dataclass_fields__) == set(COMMON_SAMPLERS) | set(EXLLAMAV2_ONLY_SAMPLERS)
    assert set(SamplingParams.__dataclass_fields__) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def test_samplers_the_engine_lacks_are_unimplemented_all_named(fake_stub):
    request = greedy("hi")
    request.sampling.top_a = 0.2
    request.sampling.banned_strings.append("cat")
    request.sampling.token_healing = True
    error = rpc_error(lambda: fake_stub.GenerateStream(request, timeout=30))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert set(bad_request_fields(error)) == {"sampling.top_a", "sampling.banned_strings", "sampling.token_healing"}
    assert error_reason(error) == "NOT_SUPPORTED"


def test_a_sampler_set_to_off_is_not_a_request_for_it(fake_stub):
    request = greedy("hi", max_new_tokens=2)
    request.sampling.top_a, request.sampling.tfs, request.sampling.skew = 0.0, 1.0, 0.0
    assert stream(fake_stub, request)[-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS


@pytest.mark.parametrize(
    "field, setter",
    [
        ("sampling.dry.multiplier", lambda s: setattr(s.dry, "multiplier", -1.0)),
        ("sampling.dry.base", lambda s: setattr(s.dry, "base", 1.0)),
        ("sampling.dry.allowed_length", lambda s: setattr(s.dry, "allowed_length", 0)),
        ("sampling.dry.penalty_last_n", lambda s: setattr(s.dry, "penalty_last_n", 1)),
        ("sampling.dry.sequence_breakers[0]", lambda s: s.dry.sequence_breakers.append("")),
        ("sampling.xtc.threshold", lambda s: setattr(s.xtc, "threshold", 0.9)),
        ("sampling.mirostat.tau", lambda s: setattr(s.mirostat, "tau", 0.0)),
        ("sampling.mirostat.eta", lambda s: setattr(s.mirostat, "eta", 2.0)),
        ("sampling.top_a", lambda s: setattr(s, "top_a", 1.5)),
        ("sampling.tfs", lambda s: setattr(s, "tfs", 0.0)),
        ("sampling.banned_strings[0]", lambda s: s.banned_strings.append("")),
    ],
)
def test_out_of_range_sampler_settings_are_invalid_before_unimplemented(fake_stub, field, setter):
    request = greedy("hi")
    setter(request.sampling)
    error = rpc_error(lambda: fake_stub.GenerateStream(request, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in bad_request_fields(error)


def test_banned_strings_and_token_healing_refuse_a_constraint(fake_stub):
    request = greedy("hi")
    request.sampling.banned_strings.append("cat")
    request.sampling.token_healing = True
    request.constraint.regex = "[a-z]+"
    error = rpc_error(lambda: fake_stub.GenerateStream(request, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {"sampling.banned_strings", "sampling.token_healing"} <= set(bad_request_fields(error))


def test_the_plain_greedy_shortcut_picks_what_llama_cpps_greedy_sampler_picks(model):
    """A plain greedy chain takes numpy's argmax; on the same logits, ties included (the first highest
    wins in both), it picks what llama.cpp's greedy sampler picks."""
    import llama_cpp

    from backend.llamacpp.batch import Batch
    from backend.llamacpp.sampling import Sampler

    ctx = model.new_context(1, 256, 64, 1)
    batch = Batch(64)
    shortcut = Sampler(SamplingParams(temperature=0.0), model, 256)
    chain = Sampler(SamplingParams(temperature=0.0), model, 256)
    chain._argmax = False  # the same greedy chain, sampled by llama.cpp
    assert shortcut._argmax
    try:
        tokens, picked = model.tokenize("The capital of France is"), []
        batch.add(0, 0, tokens, [False] * (len(tokens) - 1) + [True])
        for step in range(12):
            assert batch.decode(ctx) == 0
            row = batch.rows - 1
            logits = model.logits_row(ctx, row)
            if step % 3 == 2:  # a tie for the highest logit between two tokens
                logits[[7, 4000]] = logits.max() + 1.0
            token = shortcut.sample(ctx, row)
            assert token == chain.sample(ctx, row)
            assert step % 3 != 2 or token == 7
            picked.append(token)
            batch.clear()
            batch.add(0, len(tokens) + step, [token], [True])
        assert len(set(picked)) > 3
    finally:
        shortcut.free()
        chain.free()
        batch.free()
        llama_cpp.llama_free(ctx)
