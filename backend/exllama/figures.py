"""The exllama core's EngineStats: the same figures as the llama.cpp core's.

Jobs the generator has started run; those it holds but has not started, and those waiting in the
core's own queue, are queued; those that gave their place to another and wait to come back are
preempted. The cache's used tokens are the pages jobs hold (each reserves prompt + max_new_tokens
up front); its cached prefixes are the free pages that still hold keys and values a later prompt
can reuse (both generations list every free page, the never-used ones too, in their page table).
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.common.ledger import Ledger
from backend.common.stats import EngineStats
from backend.exllama.binding import Page
from backend.exllama.job import SampleJob


def engine_stats(
    ledger: Ledger, steps: int, jobs: list[SampleJob], pages: Sequence[Page], page_size: int, cache_tokens_total: int
) -> EngineStats:
    running = [entry for entry in jobs if entry.enqueued and entry.started]
    preempted = [entry for entry in jobs if entry.preempted]
    queued = [entry for entry in jobs if not entry.started]
    cached = [page for page in pages if page.ref_count == 0 and page.kv_position > 0]
    return ledger.snapshot(
        running, queued, preempted,
        steps=steps,
        running_sequences=len(running),
        preempted_sequences=len(preempted),
        queued_requests=len(queued),
        cache_tokens_used=sum(page.ref_count > 0 for page in pages) * page_size,
        cache_tokens_total=cache_tokens_total,
        prefix_cache_entries=len(cached),
        prefix_cache_tokens=sum(page.kv_position for page in cached),
    )
