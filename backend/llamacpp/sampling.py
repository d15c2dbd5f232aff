"""Choosing each sequence's next token from one decode's logits.

Per row to sample: the constraint's mask (llguidance fills one bitmask row per
slot, for every constrained sequence at once), the ban on end-of-generation
tokens before min_new_tokens, then the sequence's own llama.cpp sampler chain,
and logprobs when the caller asked. Every picked token is accepted by the chain
as it is picked, so checking several rows of one sequence in a step (the token
picked at each row against the token fed after it) needs no sampler rollback:
a sequence's chain and matcher only ever see the tokens it really generates.
"""

from __future__ import annotations

import ctypes
import math
import time

import llama_cpp
import llguidance
import llguidance.numpy
import numpy as np

from backend.common.cores import usable_cores
from backend.common.logprobs import with_logprobs
from backend.common.output import SequenceOutput
from backend.constraints import ConstraintState, apply_bitmask
from backend.events import GeneratedToken
from backend.llamacpp.model import GgufModel
from backend.types import COMMON_SAMPLERS, OutputParams, SamplingParams

SUPPORTED_SAMPLERS = COMMON_SAMPLERS


class Sampler:
    """One sequence's sampler chain (llama.cpp's own samplers); `free` it when the sequence ends.

    A plain greedy chain (no bias, penalties or DRY: nothing that reads or keeps state) picks the
    first highest logit, as llama.cpp's greedy sampler does; numpy finds it in a tenth of the time
    llama_sampler_sample takes to copy the vocabulary into candidates first.
    """

    def __init__(self, params: SamplingParams, model: GgufModel, context_length: int) -> None:
        self.chain: llama_cpp.llama_sampler_p | None = build_sampler_chain(params, model.vocab, model.vocab_size, context_length)
        self._looks_back = params.penalized or params.dry_on
        self._argmax = params.greedy and not (params.logit_bias or self._looks_back)
        self._model = model

    def start(self, prompt: tuple[int, ...]) -> None:
        """Penalties and DRY look back into the prompt too."""
        if self._looks_back:
            for token in prompt:
                llama_cpp.llama_sampler_accept(self.chain, token)

    def accept(self, token: int) -> None:
        """A token generated without sampling (forced by the grammar): penalties and DRY still see it."""
        llama_cpp.llama_sampler_accept(self.chain, token)

    def sample(self, ctx: llama_cpp.llama_context_p, row: int) -> int:
        """Samples from a row's logits and accepts the token."""
        if self._argmax:
            return int(self._model.logits_row(ctx, row).argmax())
        token: int = llama_cpp.llama_sampler_sample(self.chain, ctx, row)
        return token

    def free(self) -> None:
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


class TokenPicker:
    """Picks tokens from the logits of the last decode, with one bitmask row per slot for constraints."""

    def __init__(self, model: GgufModel, slots: int, compute_threads: int) -> None:
        self._model = model
        self._bitmask = llguidance.numpy.allocate_token_bitmask(slots, model.vocab_size)
        # Mask threads must not compete with llama.cpp's: only cores it leaves free fill in parallel.
        spare_cores = usable_cores() - compute_threads
        self._executor = llguidance.LLExecutor(spare_cores) if spare_cores >= 2 else None

    def fill_masks(self, constrained: list[tuple[ConstraintState, int]]) -> None:
        """Fills the bitmask row (by slot) of every constrained sequence about to be sampled (llguidance
        drops the GIL)."""
        if not constrained:
            return
        start = time.perf_counter()
        if self._executor is not None:
            rows = [(state.matcher, slot) for state, slot in constrained]
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, self._bitmask)
        else:  # measured on 2 cores: a parallel fill costs more than it saves
            for state, slot in constrained:
                llguidance.numpy.fill_next_token_bitmask(state.matcher, self._bitmask, slot)
        share = (time.perf_counter() - start) / len(constrained)
        for state, _ in constrained:
            state.mask_s += share

    def pick(
        self, ctx: llama_cpp.llama_context_p, row: int, slot: int, sampler: Sampler, output: SequenceOutput
    ) -> GeneratedToken:
        """The token sampled from a row's logits; the slot's mask row must be filled (see fill_masks).

        Raises ConstraintFailed when the sequence's matcher failed computing that mask.
        """
        logits = self._model.logits_row(ctx, row)
        if output.constraint is not None:
            output.check_constraint()
            start = time.perf_counter()
            apply_bitmask(logits, self._bitmask[slot])
            output.constraint.mask_s += time.perf_counter() - start
        if not output.eos_allowed():
            for token in self._model.eos_token_ids:
                logits[token] = -math.inf
        token = sampler.sample(ctx, row)
        return self._describe(token, logits, output.request.output)

    def forced(self, token: int) -> GeneratedToken:
        """A token the grammar left no alternative to (no logits: no logprobs)."""
        return GeneratedToken(token, self._model.pieces[token])

    def _describe(self, token: int, logits: np.ndarray, wanted: OutputParams) -> GeneratedToken:
        piece = self._model.pieces[token]
        if not wanted.return_logprobs and not wanted.top_logprobs:
            return GeneratedToken(token, piece)
        return with_logprobs(token, logits, self._model.pieces.__getitem__, wanted.top_logprobs)


def build_sampler_chain(
    params: SamplingParams, vocab: llama_cpp.llama_vocab_p, vocab_size: int, context_length: int
) -> llama_cpp.llama_sampler_p:
    """Builds a chain in llama.cpp's usual order: bias, penalties, DRY, truncation, XTC, temperature, draw.

    The caller owns the chain and frees it with `llama_cpp.llama_sampler_free`.
    """
    chain_params = llama_cpp.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain: llama_cpp.llama_sampler_p = llama_cpp.llama_sampler_chain_init(chain_params)

    def add(sampler: llama_cpp.llama_sampler_p) -> None:
        llama_cpp.llama_sampler_chain_add(chain, sampler)

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
