"""The block ledger and the event hub (backend.common.cache_events): pure bookkeeping, no model."""

from __future__ import annotations

import random

from backend.common.cache_events import (
    AllBlocksCleared,
    BlockLedger,
    BlockRemoved,
    BlockStored,
    CacheEventHub,
    chain_hashes,
)
from service.kv_publisher import encode_batch
from tests.harness.kv_subscriber import BlockIndex, decode

SIZE = 4


def rebuilt(batches) -> BlockIndex:
    index = BlockIndex()
    for batch in batches:
        index.apply(decode(encode_batch(batch))[1])
    return index


def test_a_holder_stores_its_full_blocks_as_one_chained_run():
    ledger = BlockLedger(SIZE, "CPU")
    ledger.hold("a", list(range(10)))
    [event] = ledger.flush()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(chain_hashes(list(range(8)), SIZE))
    assert event.parent_block_hash is None and event.token_ids == tuple(range(8)) and event.block_size == SIZE


def test_a_block_two_holders_share_is_stored_once_and_removed_with_the_last():
    ledger = BlockLedger(SIZE, "CPU")
    ledger.hold("a", [1] * 8)
    ledger.flush()
    ledger.hold("b", [1] * 4 + [2] * 4)
    [stored] = ledger.flush()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == chain_hashes([1] * 4, SIZE)[0]
    ledger.let_go("a")
    [removed] = ledger.flush()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 1
    ledger.let_go("b")
    [removed] = ledger.flush()
    assert len(removed.block_hashes) == 2


def test_a_handoff_between_two_flushes_publishes_nothing():
    """A sequence ending, its cells kept as an idle prefix: the blocks never left."""
    ledger = BlockLedger(SIZE, "CPU")
    ledger.hold(("seq", "r1"), list(range(12)))
    ledger.flush()
    ledger.let_go(("seq", "r1"))
    ledger.hold(("slot", 3), list(range(12)))
    assert ledger.flush() == []


def test_a_salt_changes_every_hash_of_its_chain_and_travels_with_the_first_block():
    plain, salted = chain_hashes(list(range(8)), SIZE), chain_hashes(list(range(8)), SIZE, "tenant-a")
    assert not set(plain) & set(salted)
    ledger = BlockLedger(SIZE, "CPU")
    ledger.hold("a", list(range(8)), "tenant-a")
    [event] = ledger.flush()
    assert isinstance(event, BlockStored) and event.salt == "tenant-a"
    payload = decode(encode_batch(CacheEventHub(BlockLedger(SIZE, "CPU")).snapshot()))
    assert payload[1] == [["AllBlocksCleared"]]


def test_random_holders_rebuild_exactly_and_the_snapshot_equals_the_stream():
    rng = random.Random(7)
    hub = CacheEventHub(BlockLedger(SIZE, "CPU"), replay_batches=100_000)
    seen = []
    hub.subscribe(seen.append, start=0)
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(4)]
    for _ in range(2000):
        key = rng.randrange(12)
        if rng.random() < 0.3:
            hub.ledger.let_go(key)
        else:
            stem = rng.choice(stems)
            hub.ledger.hold(key, stem[: rng.randrange(17)] + [rng.randrange(50) for _ in range(rng.randrange(10))],
                            rng.choice(["", "", "s"]))
        if rng.random() < 0.5:
            hub.publish()
            index = rebuilt(seen)
            assert index.blocks == hub.ledger.held() and index.prefixes_are_whole()
    assert [b.sequence for b in seen] == list(range(len(seen)))
    assert rebuilt([hub.snapshot()]).blocks == hub.ledger.held()


def test_a_start_no_longer_kept_asks_for_a_snapshot():
    hub = CacheEventHub(BlockLedger(SIZE, "CPU"), replay_batches=3)
    for i in range(5):
        hub.ledger.hold(i, [i] * SIZE)
        hub.publish()
    assert hub.replay(0) is None and not hub.subscribe(lambda b: None, start=0)
    assert [b.sequence for b in hub.replay(3) or []] == [3, 4, 5]
    snapshot = hub.snapshot()
    assert snapshot.sequence == 5 and snapshot.snapshot and snapshot.events[0] == AllBlocksCleared()
    assert len(rebuilt([snapshot]).blocks) == 5
