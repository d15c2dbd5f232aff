"""Per-sequence sampler chains built from llama.cpp's own samplers."""

from __future__ import annotations

import llama_cpp

from backend.types import SamplingParams

SUPPORTED_SAMPLERS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "penalty_last_n",
    "seed",
    "logit_bias",
)


def build_sampler_chain(params: SamplingParams, vocab_size: int) -> llama_cpp.llama_sampler_p:
    """Builds a chain in llama.cpp's usual order: bias, penalties, truncation, temperature, draw.

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
    add(llama_cpp.llama_sampler_init_temp(params.temperature))
    add(llama_cpp.llama_sampler_init_dist(params.seed))
    return chain
