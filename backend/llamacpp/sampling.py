"""Per-sequence sampler chains built from llama.cpp's own samplers."""

from __future__ import annotations

import ctypes

import llama_cpp

from backend.engine import COMMON_SAMPLERS
from backend.types import SamplingParams

SUPPORTED_SAMPLERS = COMMON_SAMPLERS


def build_sampler_chain(
    params: SamplingParams, vocab: llama_cpp.llama_vocab_p, vocab_size: int, context_length: int
) -> llama_cpp.llama_sampler_p:
    """Builds a chain in llama.cpp's usual order: bias, penalties, DRY, truncation, XTC, temperature, draw.

    The caller owns the chain and frees it with `llama_cpp.llama_sampler_free`.
    """
    chain_params = llama_cpp.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(chain_params)
    add = lambda sampler: llama_cpp.llama_sampler_chain_add(chain, sampler)  # noqa: E731
    if params.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, bias) for token, bias in params.logit_bias.items())
        )
        add(llama_cpp.llama_sampler_init_logit_bias(vocab_size, len(biases), biases))
    if params.penalized:
        add(
            llama_cpp.llama_sampler_init_penalties(
                vocab_size,
                params.penalty_last_n,
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
        )
    if params.dry_on:
        dry = params.dry
        breakers = (ctypes.c_char_p * len(dry.sequence_breakers))(*(b.encode() for b in dry.sequence_breakers))
        # llama.cpp copies the breakers while building the sampler; its -1 (whole context) now means off.
        add(
            llama_cpp.llama_sampler_init_dry(
                vocab, dry.multiplier, dry.base, dry.allowed_length, dry.last_n or context_length, breakers, len(breakers)
            )
        )
    if params.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.typical_p < 1.0:
        add(llama_cpp.llama_sampler_init_typical(params.typical_p, 1))
    if params.top_p < 1.0:
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    if params.xtc.probability > 0.0:
        add(llama_cpp.llama_sampler_init_xtc(params.xtc.probability, params.xtc.threshold, 1, params.seed))
    add(llama_cpp.llama_sampler_init_temp(params.temperature))
    if params.mirostat is not None:
        add(llama_cpp.llama_sampler_init_mirostat_v2(params.seed, params.mirostat.tau, params.mirostat.eta))
    else:
        add(llama_cpp.llama_sampler_init_dist(params.seed))
    return chain
