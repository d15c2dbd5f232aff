"""The llama.cpp core's KV-cache events: the index a subscriber rebuilds from them alone equals, after every
step, the blocks the core would offer another request (its idle prefixes' shared part and its live sequences'
shared cells), worked out here from the core's own state, in both reuse modes: to the token (16-token blocks,
a part block unreported) and prefix_cache_exact (64-token tiles). Real model, random requests, evictions."""

from __future__ import annotations

import random

import pytest

from backend.common.cache_events import chain_hashes
from backend.llamacpp.cache_events import BLOCK_SIZE, EXACT_BLOCK_SIZE
from backend.types import GenerationRequest, SamplingParams, StopParams
from service.kv_publisher import encode_batch
from tests.harness.core_driver import Recorder, make_core
from tests.harness.kv_subscriber import BlockIndex, decode


def reusable_blocks(core) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """What the core holds for other requests, block by block, from its prefix index and running sequences."""
    inner = core.core
    size = EXACT_BLOCK_SIZE if inner.slots.exact else BLOCK_SIZE
    runs = [entry.tokens[: entry.shared] for entry in inner.slots.prefixes._entries.values()]
    runs += [seq.tokens[: inner.slots.offered(seq)] for seq in inner.scheduler.running.values()]
    view: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for tokens in runs:
        hashes = chain_hashes(tokens, size)
        for i, h in enumerate(hashes):
            view[h] = (hashes[i - 1] if i else None, tuple(tokens[i * size : (i + 1) * size]))
    return view


def random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    stem = rng.choice(stems)
    return stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(200, 5000) for _ in range(rng.randrange(4, 45))]


@pytest.mark.parametrize("exact", [False, True], ids=["to-the-token", "exact"])
def test_the_index_rebuilt_from_events_equals_the_cores_after_every_step(model, exact):
    rng = random.Random(37)
    core = make_core(model, context_length=512, max_batch_size=3, batch_tokens=128, prefix_cache_slots=2,
                     cache_events=True, prefix_cache_exact=exact)
    hub = core.cache_events.hub
    assert hub.block_size == (EXACT_BLOCK_SIZE if exact else BLOCK_SIZE)
    batches = []
    hub.subscribe(batches.append, start=0)
    stems = [[rng.randrange(200, 5000) for _ in range(160)] for _ in range(5)]
    index = BlockIndex()
    try:
        requests, nonempty = 0, 0
        while requests < 40 or core.has_work():
            if requests < 40 and rng.random() < 0.4:
                core.add(GenerationRequest(f"r{requests}", tuple(random_prompt(rng, stems)), SamplingParams(temperature=0.0),
                                           StopParams(max_new_tokens=rng.randrange(1, 6), ignore_eos=True)), Recorder(core))
                requests += 1
            if rng.random() < 0.05 and core.scheduler.running:
                core.cancel(rng.choice(list(core.scheduler.running.values())).group)
            core.step()
            for batch in batches:
                index.apply(decode(encode_batch(batch))[1])
            batches.clear()
            assert index.blocks == reusable_blocks(core), core.steps
            nonempty += bool(index.blocks)
        assert nonempty and index.prefixes_are_whole()
        assert [b.sequence for b in hub.replay(0) or []] == list(range(hub.last_sequence + 1))
        removed = sum(1 for b in hub.replay(0) or [] for e in b.events if type(e).__name__ == "BlockRemoved")
        assert removed, "the test should evict"
    finally:
        core.close()


def test_events_off_keeps_no_ledger(model):
    core = make_core(model, context_length=256)
    try:
        assert core.cache_events is None and core.slots.prefixes.changed is None
    finally:
        core.close()


def test_a_part_block_is_reused_but_not_reported(model):
    """To the token, a request reuses every cached token; the events name only the full 16-token blocks."""
    core = make_core(model, context_length=256, max_batch_size=1, cache_events=True)
    batches = []
    core.cache_events.hub.subscribe(batches.append, start=0)
    index = BlockIndex()
    try:
        prompt = list(range(300, 320))
        for request_id, tokens in (("a", prompt), ("b", prompt + list(range(900, 905)))):
            rec = Recorder(core)
            core.add(GenerationRequest(request_id, tuple(tokens), SamplingParams(temperature=0.0),
                                       StopParams(max_new_tokens=4, ignore_eos=True)), rec)
            while core.has_work():
                core.step()
            for batch in batches:
                index.apply(decode(encode_batch(batch))[1])
            batches.clear()
            assert [tokens for _, tokens in index.blocks.values()] == [tuple(prompt[:BLOCK_SIZE])]  # 20 + 3 cells held
        assert rec.finish.usage.cached_tokens == len(prompt)  # its 4 tokens past the block came from the cache too
    finally:
        core.close()
