"""KV-cache events over ZMQ, as vLLM publishes them and llm-d's KV-cache indexer reads them.

Each batch goes out on a PUB socket as three frames: the topic, the batch's
sequence number (8 bytes, big-endian) and the msgpack payload, vLLM's msgspec
array layout: EventBatch [ts, events, data_parallel_rank], each event a tagged
array (["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name(, extra_keys)], ["BlockRemoved", block_hashes,
medium], ["AllBlocksCleared"]).

The engine thread never waits here: its listener puts the batch on a bounded
queue (a full queue drops the batch and counts it; subscribers see the gap and
catch up through replay) and one thread encodes and sends. A second thread
answers replay requests on a ROUTER socket, vLLM's protocol: a request's frame
is the 8-byte start sequence; the answer is [sequence, payload] per batch kept
from there, then [-1, b""]. A start the server no longer keeps (or -1) is
answered with a snapshot batch first: AllBlocksCleared, then every block held,
under the sequence number of the last batch it includes.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import Any

import msgpack
import zmq

from backend import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, CacheEventBatch, CacheEventHub
from service.config import ServeConfig

log = logging.getLogger(__name__)

QUEUE_BATCHES = 4096
"""Batches waiting to be sent before new ones are dropped (a subscriber catches up by replay)."""
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 200


def default_topic(model_id: str) -> str:
    """`kv@<pod>@<model>`, the topic llm-d's indexer parses; the pod is POD_IP when Kubernetes sets it, else the host name."""
    return f"kv@{os.environ.get('POD_IP') or socket.gethostname()}@{model_id}"


def encode_event(event: CacheEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        fields: list[Any] = ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                             event.block_size, None, event.medium, None]
        if event.salt:  # vLLM's extra_keys: one entry per block, the salt in the first block's
            fields.append([[event.salt]] + [None] * (len(event.block_hashes) - 1))
        return fields
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]


def encode_batch(batch: CacheEventBatch, data_parallel_rank: int = 0) -> bytes:
    payload: bytes = msgpack.packb([batch.ts, [encode_event(e) for e in batch.events], data_parallel_rank])
    return payload


def _bind_or_connect(sock: zmq.Socket[bytes], endpoint: str) -> None:
    """Binds a wildcard, ipc or inproc address and connects to any other (vLLM's rule: the stable side binds)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def cache_publisher(config: ServeConfig, hub: CacheEventHub, model_id: str) -> ZmqCachePublisher | None:
    """The ZMQ publisher of the hub's batches that the settings ask for (cache_events_endpoint), or None. Raises
    ZMQError, its message naming the setting."""
    if not config.cache_events_endpoint:
        return None
    topic = config.cache_events_topic or default_topic(model_id)
    try:
        publisher = ZmqCachePublisher(hub, config.cache_events_endpoint, topic, config.cache_events_replay_endpoint)
    except zmq.ZMQError as exc:
        raise zmq.ZMQError(exc.errno, f"cache_events_endpoint: cannot open {config.cache_events_endpoint}"
                                      f" / {config.cache_events_replay_endpoint or '-'}: {exc}") from None
    endpoint, replay = publisher.endpoints
    log.info("KV-cache events: ZMQ PUB %s (replay %s), topic %s", endpoint, replay or "off", topic)
    return publisher


class ZmqCachePublisher:
    """Publishes the hub's batches on `endpoint` under `topic`, answering replays on `replay_endpoint`."""

    def __init__(self, hub: CacheEventHub, endpoint: str, topic: str, replay_endpoint: str = "") -> None:
        self._hub = hub
        self._topic = topic.encode()
        self._queue: queue.Queue[CacheEventBatch | None] = queue.Queue(QUEUE_BATCHES)
        self.dropped = 0
        """Batches the queue had no room for."""
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._pub, endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._running = True
        self._threads = [threading.Thread(target=self._send_loop, name="kv-events-pub", daemon=True)]
        if self._replay is not None:
            self._threads.append(threading.Thread(target=self._replay_loop, name="kv-events-replay", daemon=True))
        for thread in self._threads:
            thread.start()
        # From batch 0 (AllBlocksCleared: subscribers forget this replica's past) when still kept.
        if not hub.subscribe(self._offer, start=0):
            hub.subscribe(self._offer)

    @property
    def sources(self) -> tuple[str, str, str]:
        """Where subscribers find its batches: the endpoints bound and the topic (GetModelInfo)."""
        return (*self.endpoints, self._topic.decode())

    @property
    def endpoints(self) -> tuple[str, str]:
        """The addresses actually bound (a port 0 or * resolved), for tests and logs."""
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else ""
        return pub, replay

    def _offer(self, batch: CacheEventBatch) -> None:
        """The hub's listener (engine thread): never blocks."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def _send_loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self._pub.send_multipart([self._topic, batch.sequence.to_bytes(8, "big"), encode_batch(batch)])
            except zmq.ZMQError:
                log.exception("KV event batch %d not sent", batch.sequence)
        self._pub.close()

    def _replay_loop(self) -> None:
        replay = self._replay
        assert replay is not None
        while self._running:
            if not replay.poll(_POLL_MS):
                continue
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV event replay request ignored: %d frames", len(frames))
                continue
            client, _, start = frames
            self._answer(client, int.from_bytes(start, "big", signed=True))
        replay.close()

    def _answer(self, client: bytes, start: int) -> None:
        assert self._replay is not None
        batches = self._hub.replay(start)
        if batches is None:
            snapshot = self._hub.snapshot()
            batches = [snapshot, *(self._hub.replay(snapshot.sequence + 1) or [])]
        for batch in batches:
            self._replay.send_multipart([client, b"", batch.sequence.to_bytes(8, "big"), encode_batch(batch)])
        self._replay.send_multipart([client, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self._hub.unsubscribe(self._offer)
        self._running = False
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        for thread in self._threads:
            thread.join(timeout=2.0)
