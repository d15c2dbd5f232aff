"""Continuous batching on llama.cpp's multi-sequence batch API.

Each step builds one `llama_batch` holding the next token of every decoding
sequence plus chunks of waiting prompts, runs one `llama_decode`, and samples
every sequence that produced logits with its own sampler chain. A new request
joins at the next step; a finished or cancelled one frees its cache at once.
Only the engine thread calls into this class (see backend.worker).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import heapq
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Iterable

import llama_cpp
import llguidance
import llguidance.numpy
import numpy as np

from backend.engine import EngineStats, EventSink
from backend.llamacpp.model import GgufModel
from backend.constraints import apply_bitmask
from backend.llamacpp.sampling import build_sampler_chain
from backend.logprobs import with_logprobs
from backend.sequence import SequenceOutput
from backend.types import ErrorEvent, FinishReason, GeneratedToken, GenerationRequest
from backend.worker import CancelOrder, deliver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaCppConfig:
    context_length: int = 2048
    """Most tokens one sequence may hold (prompt and output)."""
    max_batch_size: int = 8
    """Sequences decoded together; each has its own slice of the KV cache."""
    threads: int = 0
    """CPU threads for llama.cpp; 0 means every core."""
    batch_tokens: int = 512
    """Most tokens in one llama_decode call (bounds a prefill chunk)."""
    gpu_layers: int = 0
    fail_requests_with_prefix: str = ""
    """Test-only fault injection: sampling raises for request ids with this prefix."""


class _Sequence:
    def __init__(self, slot: int, request: GenerationRequest, sink: EventSink, sampler: llama_cpp.llama_sampler_p):
        self.slot = slot
        self.request = request
        self.sink = sink
        self.sampler = sampler
        self.output = SequenceOutput(request)
        self.cached = 0  # tokens of this sequence in the KV cache
        self.feed: list[int] = []  # generated (sampled or forced), not yet fed to the model
        self.paused = False  # the caller is not reading: skip it in batches, keep its cache

    @property
    def prompt_left(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids[self.cached :]


class LlamaCppCore:
    def __init__(self, model: GgufModel, config: LlamaCppConfig) -> None:
        if config.max_batch_size > config.batch_tokens:
            raise ValueError("batch_tokens must be at least max_batch_size")
        self.model = model
        self.config = config
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.context_length * config.max_batch_size
        params.n_batch = params.n_ubatch = config.batch_tokens
        params.n_seq_max = config.max_batch_size
        params.n_threads = params.n_threads_batch = config.threads or os.cpu_count() or 1
        # A cache per sequence keeps each sequence's attention separate, so greedy output does
        # not depend on what else is in the batch. llama.cpp is fast with it only while a batch's
        # sequences have ascending, contiguous ids (see _fill_batch and docs/benchmarks.md).
        params.kv_unified = False
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.context_length: int = llama_cpp.llama_n_ctx_seq(self.ctx)
        self._memory = llama_cpp.llama_get_memory(self.ctx)
        self._batch = llama_cpp.llama_batch_init(config.batch_tokens, 0, 1)
        self._free_slots = list(range(config.max_batch_size))  # a heap: the lowest slot goes first
        self._waiting: collections.deque[tuple[GenerationRequest, EventSink]] = collections.deque()
        self._running: dict[str, _Sequence] = {}
        self.steps = 0
        self.stats = EngineStats(cache_tokens_total=config.context_length * config.max_batch_size)
        # One bitmask row per slot, filled for every constrained sequence about to be sampled.
        self._bitmask = llguidance.numpy.allocate_token_bitmask(config.max_batch_size, model.vocab_size)
        # Mask threads must not compete with llama.cpp's: only cores it leaves free fill in parallel.
        spare_cores = (os.cpu_count() or 1) - params.n_threads
        self._mask_executor = llguidance.LLExecutor(spare_cores) if spare_cores >= 2 else None
        # Cap the forced tokens taken at once, so every sequence's feed fits a batch.
        self._max_forced = max(0, min(16, config.batch_tokens // config.max_batch_size - 1))

    # -- commands ------------------------------------------------------------

    def add(self, request: GenerationRequest, sink: EventSink) -> None:
        self._waiting.append((request, sink))
        self._publish()

    def cancel(self, order: CancelOrder | str) -> None:
        if isinstance(order, str):
            order = CancelOrder(order, time.monotonic(), self.steps)
        seq = self._running.get(order.request_id)
        if seq is not None:
            self._end(seq, FinishReason.CANCELLED)
        elif not self._end_waiting(order.request_id, FinishReason.CANCELLED):
            return  # already finished: nothing to free
        latency_steps = self.steps - order.issued_at_step
        self.stats = dataclasses.replace(
            self.stats,
            cancelled_total=self.stats.cancelled_total + 1,
            last_cancel_latency_steps=latency_steps,
            last_cancel_latency_s=time.monotonic() - order.issued_at,
            max_cancel_latency_steps=max(self.stats.max_cancel_latency_steps, latency_steps),
        )
        self._publish()

    def pause(self, request_id: str) -> None:
        self._set_paused(request_id, True)

    def resume(self, request_id: str) -> None:
        self._set_paused(request_id, False)

    def has_work(self) -> bool:
        return bool(self._waiting and self._free_slots) or any(not seq.paused for seq in self._running.values())

    def holds_sequences(self) -> bool:
        return bool(self._waiting or self._running)

    def expire(self) -> None:
        now = time.monotonic()
        for request, _ in [entry for entry in self._waiting if SequenceOutput(entry[0]).deadline_passed(now)]:
            self._end_waiting(request.request_id, FinishReason.TIME_LIMIT)  # never started
        for seq in [seq for seq in self._running.values() if seq.output.deadline_passed(now)]:
            self._end(seq, FinishReason.TIME_LIMIT)
        self._publish()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def cache_cells_used(self) -> int:
        return sum(seq.cached for seq in self._running.values())

    def _set_paused(self, request_id: str, paused: bool) -> None:
        seq = self._running.get(request_id)
        if seq is not None:
            seq.paused = paused
        self._publish()

    def _end_waiting(self, request_id: str, reason: FinishReason) -> bool:
        for i, (request, sink) in enumerate(self._waiting):
            if request.request_id == request_id:
                del self._waiting[i]
                deliver(sink, SequenceOutput(request).end(reason))
                return True
        return False

    def _publish(self) -> None:
        """Replaces the stats snapshot (one reference assignment: atomic for readers)."""
        self.stats = dataclasses.replace(
            self.stats,
            steps=self.steps,
            running_sequences=len(self._running),
            paused_sequences=sum(seq.paused for seq in self._running.values()),
            queued_requests=len(self._waiting),
            cache_tokens_used=self.cache_cells_used,
        )

    # -- one step --------------------------------------------------------------

    def step(self) -> None:
        self.steps += 1
        self.expire()
        self._admit()
        self._compact()
        scheduled = self._fill_batch()
        if not scheduled:
            self._publish()
            return
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        if rc != 0:
            for seq, _ in scheduled:
                self._fail(seq, f"llama_decode failed with status {rc}")
            return
        self._fill_constraint_masks(seq for seq, index in scheduled if index is not None)
        for seq, logits_index in scheduled:
            if logits_index is None or seq.request.request_id not in self._running:
                continue
            try:
                self._sample(seq, logits_index)
            except Exception as exc:  # one sequence's fault must not end the others
                log.exception("sampling failed for %s", seq.request.request_id)
                self._fail(seq, f"sampling failed: {exc}")
        self._publish()

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            request, sink = self._waiting.popleft()
            slot = heapq.heappop(self._free_slots)
            chain = build_sampler_chain(request.sampling, self.model.vocab, self.model.vocab_size, self.context_length)
            seq = _Sequence(slot, request, sink, chain)
            if request.sampling.penalized or request.sampling.dry_on:  # they look back into the prompt too
                for token in request.prompt_token_ids:
                    llama_cpp.llama_sampler_accept(seq.sampler, token)
            seq.output.mark_admitted()
            self._running[request.request_id] = seq
            self.stats = dataclasses.replace(self.stats, started_total=self.stats.started_total + 1)

    def _compact(self) -> None:
        """Keeps the decoding sequences on contiguous slots, one move per step.

        llama.cpp's per-sequence cache decodes a batch whose ids have a gap (left by a finished
        or paused sequence) 22% slower at 8 sequences. Moving the highest decoding sequence into
        the lowest hole copies one cache stream (a few milliseconds) and removes the gap.
        """
        decoding = sorted((seq for seq in self._running.values() if not seq.paused), key=lambda seq: seq.slot)
        if not decoding:
            return
        top = decoding[-1]
        taken = {seq.slot for seq in decoding}
        hole = next((slot for slot in range(top.slot) if slot not in taken), None)
        if hole is None:
            return
        parked = next((seq for seq in self._running.values() if seq.slot == hole), None)
        if parked is None:
            self._move(top, hole)
        elif self._free_slots and max(self._free_slots) > top.slot:
            self._move(parked, max(self._free_slots))  # a paused sequence waits above the decoding ones

    def _move(self, seq: _Sequence, slot: int) -> None:
        """Moves a sequence's cache to a free slot; llama.cpp copies the stream before the next decode."""
        self._free_slots.remove(slot)
        llama_cpp.llama_memory_seq_cp(self._memory, seq.slot, slot, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
        self._free_slots.append(seq.slot)
        heapq.heapify(self._free_slots)
        seq.slot = slot

    def _fill_batch(self) -> list[tuple[_Sequence, int | None]]:
        """Decoding sequences first (one token each), then prompt chunks in arrival order."""
        batch = self._batch
        n = 0
        scheduled: list[tuple[_Sequence, int | None]] = []

        def put(seq: _Sequence, token: int, wants_logits: bool) -> None:
            nonlocal n
            batch.token[n] = token
            batch.pos[n] = seq.cached
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq.slot
            batch.logits[n] = wants_logits
            seq.cached += 1
            n += 1

        # With a cache per sequence, llama.cpp splits a batch into equal-length pieces per
        # sequence, so several tokens of one sequence beside others would cost extra forward
        # passes. Forced tokens therefore go all at once only when a sequence runs alone.
        per_sequence = self.config.batch_tokens if len(self._running) == 1 else 1
        # Tokens in ascending sequence order: llama.cpp's per-sequence cache takes a much slower
        # path (measured: 1.7x per step at 8 sequences) when a batch lists sequences out of order.
        # Lowest-slot-first admission keeps the ids contiguous, which it also needs.
        running = sorted(self._running.values(), key=lambda seq: seq.slot)
        for seq in running:
            if seq.feed and not seq.paused:
                chunk, seq.feed = seq.feed[:per_sequence], seq.feed[per_sequence:]
                for token in chunk:
                    put(seq, token, False)
                batch.logits[n - 1] = not seq.feed  # sample only once every known token is in
                scheduled.append((seq, n - 1 if not seq.feed else None))
        for seq in running:
            budget = self.config.batch_tokens - n
            if budget <= 0:
                break
            remaining = seq.prompt_left
            if remaining:
                completes = len(remaining) <= budget
                for token in remaining[:budget]:
                    put(seq, token, False)
                batch.logits[n - 1] = completes  # logits only for a prompt's last token
                scheduled.append((seq, n - 1 if completes else None))
        batch.n_tokens = n
        return scheduled

    def _fill_constraint_masks(self, sampling: Iterable[_Sequence]) -> None:
        """Fills the bitmask row of every constrained sequence about to be sampled (llguidance drops the GIL)."""
        rows = [(seq.output.constraint, seq.slot) for seq in sampling if seq.output.constraint is not None]
        if not rows:
            return
        start = time.perf_counter()
        if self._mask_executor is not None:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._mask_executor, [(state.matcher, slot) for state, slot in rows], self._bitmask
            )
        else:  # measured on 2 cores: a parallel fill costs more than it saves
            for state, slot in rows:
                llguidance.numpy.fill_next_token_bitmask(state.matcher, self._bitmask, slot)
        share = (time.perf_counter() - start) / len(rows)
        for state, _ in rows:
            state.mask_s += share

    def _sample(self, seq: _Sequence, logits_index: int) -> None:
        output = seq.output
        output.step = self.steps
        fault_prefix = self.config.fail_requests_with_prefix
        if fault_prefix and seq.request.request_id.startswith(fault_prefix):
            raise RuntimeError("injected fault (fail_requests_with_prefix)")
        logits = llama_cpp.llama_get_logits_ith(self.ctx, logits_index)
        if output.constraint is not None:
            start = time.perf_counter()
            apply_bitmask(np.ctypeslib.as_array(logits, shape=(self.model.vocab_size,)), self._bitmask[seq.slot])
            output.constraint.mask_s += time.perf_counter() - start
        if not output.eos_allowed():
            for token in self.model.eos_token_ids:
                logits[token] = -math.inf
        token = llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, logits_index)
        generated = [token]
        deliver(seq.sink, output.on_token(self._describe(token, logits, seq.request), self._is_eos(token)))
        if not output.finished and output.constraint is not None:
            for forced in output.constraint.forced_tokens(self._max_forced):  # no choice left: skip sampling
                llama_cpp.llama_sampler_accept(seq.sampler, forced)  # penalties and DRY still see it
                generated.append(forced)
                piece = GeneratedToken(forced, self.model.pieces[forced])
                deliver(seq.sink, output.on_token(piece, self._is_eos(forced)))
                if output.finished:
                    break
        if output.finished:
            self._release(seq)
        elif seq.cached + len(generated) >= self.context_length:  # prompt + output now fill the context
            self._end(seq, FinishReason.CONTEXT_LIMIT)
        else:
            seq.feed = generated

    def _is_eos(self, token: int) -> bool:
        return token in self.model.eos_token_set

    def _describe(self, token: int, logits: ctypes.POINTER(ctypes.c_float), request: GenerationRequest) -> GeneratedToken:
        piece = self.model.pieces[token]
        wanted = request.output
        if not wanted.return_logprobs and not wanted.top_logprobs:
            return GeneratedToken(token, piece)
        row = np.ctypeslib.as_array(logits, shape=(self.model.vocab_size,))
        return with_logprobs(token, row, self.model.pieces.__getitem__, wanted.top_logprobs)

    # -- endings -----------------------------------------------------------------

    def _end(self, seq: _Sequence, reason: FinishReason) -> None:
        deliver(seq.sink, seq.output.end(reason))
        self._release(seq)

    def _fail(self, seq: _Sequence, message: str) -> None:
        deliver(seq.sink, ErrorEvent(message))
        self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        del self._running[seq.request.request_id]
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
        llama_cpp.llama_sampler_free(seq.sampler)
        heapq.heappush(self._free_slots, seq.slot)
        seq.cached = 0

    def close(self) -> None:
        for seq in list(self._running.values()):
            self._end(seq, FinishReason.CANCELLED)
        while self._waiting:
            request, sink = self._waiting.popleft()
            deliver(sink, SequenceOutput(request).end(FinishReason.CANCELLED))
        if self.ctx:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
