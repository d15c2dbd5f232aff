"""The dynamic generator, its jobs and greedy settings, as bench/gpu drives them: jobs start as the
batch allows (all up to max_batch_size paged, one at a time unpaged), each iterate() gives every
active job one token, and in paged mode each step's attention runs through the provider tokenspout
lent exllamav2 (exllamav2.attn.flash_attn_with_kvcache), batched over the active jobs with a block table."""

from __future__ import annotations

import types

import torch

from .. import attn

PAGE = 256
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # small: the Triton kernel runs in its interpreter here


class ExLlamaV2Sampler:
    class Settings:
        @staticmethod
        def greedy(**kwargs):
            return types.SimpleNamespace(top_k=1, **kwargs)


class ExLlamaV2DynamicJob:
    def __init__(self, input_ids: torch.Tensor, max_new_tokens: int, identifier=None, **kwargs) -> None:
        self.ids, self.max_new_tokens, self.identifier, self.generated = input_ids[0].tolist(), max_new_tokens, identifier, 0


class ExLlamaV2DynamicGenerator:
    def __init__(self, model, cache, tokenizer, max_batch_size: int = 16, paged: bool = True, max_chunk_size: int = 2048,
                 **kwargs) -> None:
        if paged:
            assert attn.has_flash_attn_with_paged and not model.config.no_flash_attn
            assert max_chunk_size % PAGE == 0 and cache.max_seq_len % PAGE == 0
        self.model, self.paged, self.max_batch_size = model, paged, max_batch_size
        self.vocab = model.config.vocab_size
        self.pending_jobs: list[ExLlamaV2DynamicJob] = []
        self.active_jobs: list[ExLlamaV2DynamicJob] = []

    def enqueue(self, job: ExLlamaV2DynamicJob) -> None:
        self.pending_jobs.append(job)

    def clear_queue(self) -> None:
        self.pending_jobs.clear()
        self.active_jobs.clear()

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def iterate(self) -> list[dict]:
        while self.pending_jobs and len(self.active_jobs) < (self.max_batch_size if self.paged else 1):
            self.active_jobs.append(self.pending_jobs.pop(0))
        if self.paged and self.active_jobs:
            self.attend([len(job.ids) + job.generated for job in self.active_jobs])
        results = []
        for job in list(self.active_jobs):
            token = (sum(job.ids) + 7 * job.generated) % self.vocab
            job.generated += 1
            result = {"identifier": job.identifier, "stage": "streaming", "eos": False, "token_ids": torch.tensor([[token]])}
            if job.generated == job.max_new_tokens:
                result["eos"] = True
                self.active_jobs.remove(job)
            results.append(result)
        return results

    @staticmethod
    def attend(lengths: list[int]) -> None:
        batch, pages = len(lengths), -(-(max(lengths) + 1) // PAGE)
        q = torch.randn(batch, 1, HEADS, HEAD_DIM)
        k_cache = torch.zeros(batch * pages + 1, PAGE, KV_HEADS, HEAD_DIM)
        block_table = (torch.arange(batch * pages, dtype=torch.int32) + 1).reshape(batch, pages)
        attn.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k=torch.randn(batch, 1, KV_HEADS, HEAD_DIM),
                                     v=torch.randn(batch, 1, KV_HEADS, HEAD_DIM),
                                     cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=block_table,
                                     causal=True)
