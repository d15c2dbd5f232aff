"""The edge's checks on SamplingParams: every sampler's range, logit bias, banned strings, DRY, and
each sample's seed."""

from __future__ import annotations

import math
import secrets

from backend import DEFAULT_DRY_BREAKERS, DryParams, MirostatParams, ModelInfo, SamplingParams, XtcParams
from service.errors import FieldViolation
from service.fields import RangeChecker, checked, listed_strings
from service.limits import Limits
from tokenspout.v1 import generation_pb2 as pb

MAX_SEED = 2**32 - 2  # llama.cpp reserves 2**32 - 1 for "random"


def sampling_params(s: pb.SamplingParams, info: ModelInfo, limits: Limits, violations: list[FieldViolation]) -> SamplingParams:
    """The request's sampling as the engine takes it; each field out of range is added to `violations`."""
    check = RangeChecker("sampling", s, violations)
    check.range("temperature", 0.0, 100.0)
    check.range("top_k", 0, info.vocab_size)
    check.range("top_p", 0.0, 1.0, low_open=True)
    check.range("min_p", 0.0, 1.0)
    check.range("typical_p", 0.0, 1.0, low_open=True)
    check.range("repetition_penalty", 0.0, 10.0, low_open=True)
    check.range("presence_penalty", -2.0, 2.0)
    check.range("frequency_penalty", -2.0, 2.0)
    check.range("penalty_last_n", 0, info.context_length)
    check.range("seed", 0, MAX_SEED)
    if len(s.logit_bias) > limits.max_logit_bias_entries:
        violations.append(FieldViolation("sampling.logit_bias", f"at most {limits.max_logit_bias_entries} entries"))
    for token, bias in s.logit_bias.items():
        if not 0 <= token < info.vocab_size:
            violations.append(FieldViolation(f"sampling.logit_bias[{token}]", "not a token id of this model"))
        elif not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            violations.append(FieldViolation(f"sampling.logit_bias[{token}]", "bias must be in [-100, 100]"))
    check.range("top_a", 0.0, 1.0)
    check.range("tfs", 0.0, 1.0, low_open=True)
    check.range("skew", -5.0, 5.0)
    check.range("smoothing_factor", 0.0, 10.0)
    violations.extend(listed_strings("sampling.banned_strings", s.banned_strings, limits.max_banned_strings,
                                      limits.max_banned_string_length))
    default = SamplingParams  # its class attributes are the defaults of the fields left unset
    temperature = check.real("temperature", default.temperature)
    if check.has("seed"):
        seed = check.integer("seed", 0)
    else:
        seed = 0 if SamplingParams.greedy_at(temperature) else secrets.randbelow(MAX_SEED + 1)
    # The sub-messages are checked only when set: a request rarely sets them.
    xtc = checked(s.xtc, "sampling.xtc", violations, probability=(0.0, 1.0), threshold=(0.0, 0.5)) if s.HasField("xtc") else {}
    mirostat = (checked(s.mirostat, "sampling.mirostat", violations, tau=(0.0, 20.0, True), eta=(0.0, 1.0, True))
                if s.HasField("mirostat") else None)
    return SamplingParams(
        temperature=temperature,
        top_k=check.integer("top_k", default.top_k),
        top_p=check.real("top_p", default.top_p),
        min_p=check.real("min_p", default.min_p),
        typical_p=check.real("typical_p", default.typical_p),
        repetition_penalty=check.real("repetition_penalty", default.repetition_penalty),
        presence_penalty=check.real("presence_penalty", default.presence_penalty),
        frequency_penalty=check.real("frequency_penalty", default.frequency_penalty),
        penalty_last_n=check.integer("penalty_last_n", default.penalty_last_n),
        seed=seed,
        top_a=check.real("top_a", default.top_a),
        tfs=check.real("tfs", default.tfs),
        skew=check.real("skew", default.skew),
        smoothing_factor=check.real("smoothing_factor", default.smoothing_factor),
        logit_bias=dict(s.logit_bias),
        dry=_dry(s.dry, info, limits, violations) if s.HasField("dry") else default.dry,
        xtc=XtcParams(**xtc),
        mirostat=MirostatParams(**mirostat) if mirostat is not None else None,
        banned_strings=tuple(s.banned_strings),
        token_healing=s.token_healing,
    )

def _dry(d: pb.DrySampler, info: ModelInfo, limits: Limits, violations: list[FieldViolation]) -> DryParams:
    check = RangeChecker("sampling.dry", d, violations)
    check.range("multiplier", 0.0, 10.0)
    check.range("base", 1.0, 10.0, low_open=True)
    check.range("allowed_length", 1, 64)
    check.range("penalty_last_n", 0, info.context_length)
    if check.integer("penalty_last_n", 0) == 1:
        violations.append(FieldViolation("sampling.dry.penalty_last_n", "must be 0 (whole context) or at least 2"))
    violations.extend(listed_strings("sampling.dry.sequence_breakers", d.sequence_breakers,
                                      limits.max_dry_breakers, limits.max_dry_breaker_length))
    default = DryParams
    return DryParams(
        multiplier=check.real("multiplier", default.multiplier),
        base=check.real("base", default.base),
        allowed_length=check.integer("allowed_length", default.allowed_length),
        last_n=check.integer("penalty_last_n", default.last_n),
        sequence_breakers=tuple(d.sequence_breakers) or DEFAULT_DRY_BREAKERS,
    )


def sample_seeds(request: pb.GenerateStreamRequest, sampling: SamplingParams) -> tuple[int, ...]:
    """Each sample's seed: the request's seed + the sample's index when it gave one, else random (0: greedy)."""
    if sampling.greedy:
        return (0,) * request.n
    if request.sampling.HasField("seed"):
        return tuple((sampling.seed + i) % (MAX_SEED + 1) for i in range(request.n))
    return (sampling.seed, *(secrets.randbelow(MAX_SEED + 1) for _ in range(request.n - 1)))
