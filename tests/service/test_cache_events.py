"""KV-cache events end to end: a real server on the embedded model publishing over a real ZMQ PUB socket
and WatchCacheEvents; a late ZMQ subscriber (snapshot over replay) and a gRPC watcher each rebuild the block
index from the events alone, and it equals the server's own (a fresh snapshot) after random requests with
evictions, with gapless sequence numbers. The settings' refusals run on the fake engine."""

from __future__ import annotations

import concurrent.futures
import random

import grpc
import pytest

from backend.config import EngineConfig, EngineKind
from backend.llamacpp.cache_events import BLOCK_SIZE
from service.config import ServeConfig
from tests.harness.helpers import rpc_error, wait_for
from tests.harness.kv_subscriber import GrpcFollower, ZmqFollower, random_request
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

REQUESTS = 36


@pytest.fixture(scope="module")
def events_server(tmp_path_factory, model_path):
    running = start_server(
        tmp_path_factory.mktemp("kv-events"), "--context-length", "512", "--max-batch-size", "3",
        "--prefix-cache-slots", "2", "--cache-events", "--cache-events-endpoint", "tcp://127.0.0.1:*",
        "--cache-events-replay-endpoint", "tcp://127.0.0.1:*",
    )
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture(scope="module")
def events_stub(events_server):
    with grpc.insecure_channel(events_server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)



def quiet_sequence(stub) -> int:
    """The last batch's number once the server is idle and its count holds still."""
    def settled():
        first = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        second = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        idle = not second.running_sequences and not second.queued_requests
        return idle and first.cache_events_sequence == second.cache_events_sequence and second.cache_events_sequence + 1
    return wait_for(settled, what="an idle server") - 1


def snapshot_of(stub) -> GrpcFollower:
    follower = GrpcFollower(stub, pb.WatchCacheEventsRequest(snapshot=True))
    wait_for(lambda: follower.sequences, what="a snapshot")
    follower.close()
    return follower


def test_subscribers_rebuild_the_servers_index_from_events_alone(events_stub):
    stub = events_stub
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    sources = info.cache_event_sources
    assert info.cache_block_size == BLOCK_SIZE and sources.endpoint.startswith("tcp://127.0.0.1:") and sources.replay_endpoint
    assert sources.topic.startswith("kv@") and sources.topic.endswith(f"@{info.model_id}")
    rng = random.Random(1037)
    stems = [[rng.randrange(300, 4000) for _ in range(130)] for _ in range(5)]
    bos = info.special_tokens.bos_token_id
    watcher = GrpcFollower(stub, pb.WatchCacheEventsRequest(start_sequence=0))  # from the server's start
    late = None
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i in range(REQUESTS):
            if i == REQUESTS // 3:
                late = ZmqFollower(sources.endpoint, sources.replay_endpoint, sources.topic)
            list(pool.map(lambda r: list(stub.GenerateStream(r, timeout=120)),
                          [random_request(rng, stems, bos, 40, 5) for _ in range(rng.randrange(1, 4))]))
            if late is not None:
                late.poll(0.01)
    last = quiet_sequence(stub)
    assert late is not None
    wait_for(lambda: late.poll(0.2) is not None and late.next_sequence == last + 1, what="the ZMQ subscriber")
    wait_for(lambda: watcher.sequences and watcher.sequences[-1] == last, what="the gRPC watcher")
    watcher.close()
    assert watcher.error is None or watcher.error.code() is grpc.StatusCode.CANCELLED, watcher.error
    own = snapshot_of(stub)
    assert own.snapshots == [last] and own.index.blocks and own.index.prefixes_are_whole()
    assert late.index.blocks == own.index.blocks and watcher.index.blocks == own.index.blocks
    # Gapless: the watcher from batch 0 saw every batch; the late subscriber every one after its snapshot.
    assert watcher.sequences == list(range(last + 1))
    assert late.snapshots == 1 and late.sequences == list(range(late.sequences[0], last + 1))
    assert late.topics == {sources.topic.encode()}
    fresh = ZmqFollower(sources.endpoint, sources.replay_endpoint)
    try:
        fresh.catch_up(0)  # the whole history, replayed
        assert fresh.index.blocks == own.index.blocks and fresh.sequences == list(range(last + 1))
        assert fresh.index.removed, "the requests should have evicted prefixes"
    finally:
        fresh.close()
        late.close()


def test_status_reports_the_block_size_and_the_last_sequence(events_stub):
    status = events_stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
    assert status.cache_block_size == BLOCK_SIZE and status.cache_events_sequence >= 0


def test_a_start_no_longer_kept_is_out_of_range(events_stub):
    error = rpc_error(lambda: next(events_stub.WatchCacheEvents(
        pb.WatchCacheEventsRequest(start_sequence=10**12), timeout=10)))
    assert error.code() is grpc.StatusCode.OUT_OF_RANGE and "start_sequence" in error.details()


def test_watching_without_events_is_unimplemented(fake_stub):
    error = rpc_error(lambda: next(fake_stub.WatchCacheEvents(pb.WatchCacheEventsRequest(snapshot=True), timeout=10)))
    assert error.code() is grpc.StatusCode.UNIMPLEMENTED and "cache_events" in error.details()
    info = fake_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.cache_block_size == 0 and not info.cache_event_sources.endpoint


@pytest.mark.parametrize(("settings", "named"), [
    ({"cache_events_endpoint": "tcp://*:5557"}, "need cache_events = true"),
    ({"cache_events_replay_endpoint": "tcp://*:5558", "engine": EngineConfig(cache_events=True)},
     "needs cache_events_endpoint"),
])
def test_publishing_settings_need_their_companions(settings, named):
    with pytest.raises(ValueError, match=named):
        ServeConfig(**settings)


def test_exllamav2_and_events_without_the_prefix_cache_refuse_to_start():
    with pytest.raises(ValueError, match="exllamav2 engine publishes no cache events"):
        EngineConfig(kind=EngineKind.EXLLAMAV2, cache_events=True)
    with pytest.raises(ValueError, match="needs prefix_cache"):
        EngineConfig.of(cache_events=True, prefix_cache=False)


def test_a_watcher_that_falls_behind_gets_a_snapshot_instead_of_a_wrong_index():
    import asyncio

    from backend.common.cache_events import BlockLedger, CacheEventHub
    from service.cache_watch import CacheWatches
    from tests.harness.kv_subscriber import BlockIndex, events_of

    async def scenario():
        hub = CacheEventHub(BlockLedger(4, "CPU"))
        watches = CacheWatches(hub, "llama.cpp", max_behind=3)
        stream = watches.watch(pb.WatchCacheEventsRequest(start_sequence=0))
        index, seen = BlockIndex(), []
        first = await anext(stream)  # batch 0, then the watcher stops reading while 20 batches go out
        index.apply(events_of(first))
        for i in range(20):
            hub.ledger.hold(i % 5, [i] * 4 + [i + 1] * 4)
            hub.publish()
        await asyncio.sleep(0)
        while not seen or seen[-1].sequence != hub.last_sequence:
            message = await anext(stream)
            if message.snapshot:
                index.blocks.clear()
            index.apply(events_of(message))
            seen.append(message)
        watches.end_all()
        await stream.aclose()
        return hub, index, seen

    hub, index, seen = asyncio.run(scenario())
    assert any(m.snapshot for m in seen) and index.blocks == hub.ledger.held()
