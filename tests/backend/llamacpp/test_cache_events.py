"""The llama.cpp core's KV-cache events: the index a subscriber rebuilds from them alone equals, after every
step, the blocks the core would offer another request (its idle prefixes' shared part and its live sequences'
computed prompts), worked out here from the core's own state. Real model, random requests, evictions."""

from __future__ import annotations

import random

from backend.common.cache_events import chain_hashes
from backend.llamacpp.cache_events import BLOCK_SIZE, live_cells
from backend.types import GenerationRequest, SamplingParams, StopParams
from service.kv_publisher import encode_batch
from tests.harness.core_driver import Recorder, make_core
from tests.harness.kv_subscriber import BlockIndex, decode


def reusable_blocks(core) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """What the core holds for other requests, block by block, from its prefix index and running sequences."""
    inner = core.core
    runs = [entry.tokens[: entry.shared] for entry in inner.slots.prefixes._entries.values()]
    runs += [seq.tokens[: live_cells(seq)] for seq in inner.scheduler.running.values()]
    view: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for tokens in runs:
        hashes = chain_hashes(tokens, BLOCK_SIZE)
        for i, h in enumerate(hashes):
            view[h] = (hashes[i - 1] if i else None, tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
    return view


def random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    stem = rng.choice(stems)
    return stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(200, 5000) for _ in range(rng.randrange(4, 90))]


def test_the_index_rebuilt_from_events_equals_the_cores_after_every_step(model):
    rng = random.Random(37)
    core = make_core(model, context_length=512, max_batch_size=3, batch_tokens=128, prefix_cache_slots=2,
                     cache_events=True)
    hub = core.cache_events.hub
    batches = []
    hub.subscribe(batches.append, start=0)
    stems = [[rng.randrange(200, 5000) for _ in range(300)] for _ in range(5)]
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
