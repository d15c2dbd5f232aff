"""A router's side of the KV-cache events: decode vLLM's msgpack batches, rebuild the block index from
them alone, and follow a ZMQ PUB stream with gap detection and replay/snapshot, as llm-d's indexer does.
Shared by the tests and bench/suite/kv_events.py."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from tokenspout.v1 import generation_pb2 as pb

END_OF_REPLAY = -1


@dataclass
class BlockIndex:
    """hash -> (parent hash, token ids), from events alone."""

    blocks: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    block_size: int = 0
    salts: dict[int, str] = field(default_factory=dict)
    removed: int = 0
    """Blocks removed so far (evictions seen)."""

    def apply(self, events: list[list[Any]]) -> None:
        for event in events:
            kind = event[0]
            if kind == "BlockStored":
                hashes, parent, tokens, size = event[1], event[2], event[3], event[4]
                assert event[6] in ("CPU", "GPU") and len(tokens) == size * len(hashes), event
                self.block_size = size
                for i, h in enumerate(hashes):
                    assert h not in self.blocks, f"block {h:x} stored twice"
                    self.blocks[h] = (parent if i == 0 else hashes[i - 1], tuple(tokens[i * size : (i + 1) * size]))
                if len(event) > 8 and event[8] and event[8][0]:
                    self.salts[hashes[0]] = event[8][0][0]
            elif kind == "BlockRemoved":
                for h in event[1]:
                    assert h in self.blocks, f"block {h:x} removed but never stored"
                    del self.blocks[h]
                    self.removed += 1
            else:
                assert kind == "AllBlocksCleared", event
                self.blocks.clear()

    def prefixes_are_whole(self) -> bool:
        """Every block's parent is held too: a chain is never missing its start."""
        return all(parent is None or parent in self.blocks for parent, _ in self.blocks.values())


def decode(payload: bytes) -> tuple[float, list[list[Any]], int]:
    ts, events, rank = msgpack.unpackb(payload, strict_map_key=False)
    return ts, events, rank


class ZmqFollower:
    """Subscribes to a PUB endpoint and keeps a BlockIndex; catches up through the replay endpoint."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "") -> None:
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.index = BlockIndex()
        self.next_sequence: int | None = None
        self.sequences: list[int] = []
        self.topics: set[bytes] = set()
        self.replays = 0
        self.snapshots = 0

    def catch_up(self, start: int) -> None:
        """Asks the replay endpoint for batches from `start` (-1: a snapshot) and applies them. An answer
        that does not start at `start` starts with a snapshot: the index starts again from it."""
        self.replays += 1
        req = self.context.socket(zmq.DEALER)  # one request, many answers: a REQ socket takes only one
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            first = True
            while True:
                assert req.poll(5000), "no replay answer"
                _, seq_bytes, payload = req.recv_multipart()
                sequence = int.from_bytes(seq_bytes, "big", signed=True)
                if sequence == END_OF_REPLAY:
                    return
                if first and sequence != start:
                    events = decode(payload)[1]
                    assert events and events[0][0] == "AllBlocksCleared", "a snapshot starts by clearing"
                    self.next_sequence = None
                    self.snapshots += 1
                first = False
                self._apply(sequence, payload)
        finally:
            req.close()

    def _apply(self, sequence: int, payload: bytes) -> None:
        if self.next_sequence is not None:
            if sequence < self.next_sequence:
                return  # had it already
            assert sequence == self.next_sequence, f"gap: expected {self.next_sequence}, got {sequence}"
        self.index.apply(decode(payload)[1])
        self.sequences.append(sequence)
        self.next_sequence = sequence + 1

    def poll(self, timeout_s: float = 0.2) -> int:
        """Applies what arrives on the PUB socket within `timeout_s`: a late joiner takes a snapshot first, and a
        gap is filled by replay."""
        applied = 0
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self.sub.poll(int(left * 1000) + 1):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            sequence = int.from_bytes(seq_bytes, "big")
            if self.next_sequence is None:
                self.catch_up(-1)
            assert self.next_sequence is not None
            if sequence > self.next_sequence:
                self.catch_up(self.next_sequence)
            if sequence >= self.next_sequence:
                self._apply(sequence, payload)
            applied += 1
        return applied

    def close(self) -> None:
        self.sub.close()


def events_of(response) -> list[list[Any]]:
    """A WatchCacheEvents message's events in the msgpack layout, so one BlockIndex reads both."""
    events: list[list[Any]] = []
    for event in response.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            events.append(["BlockStored", list(stored.block_hashes), parent, list(stored.token_ids),
                           stored.block_size, None, stored.medium, None])
        elif kind == "block_removed":
            events.append(["BlockRemoved", list(event.block_removed.block_hashes), event.block_removed.medium])
        else:
            events.append(["AllBlocksCleared"])
    return events


class GrpcFollower:
    """Follows WatchCacheEvents on its own thread, keeping a BlockIndex and the sequence numbers seen."""

    def __init__(self, stub, request, metadata=()) -> None:
        import threading

        self.index = BlockIndex()
        self.sequences: list[int] = []
        self.snapshots: list[int] = []
        self.error: BaseException | None = None
        self.call = stub.WatchCacheEvents(request, metadata=metadata)
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            for response in self.call:
                if response.snapshot:
                    self.snapshots.append(response.sequence)
                    self.index.blocks.clear()
                elif self.sequences:
                    assert response.sequence == self.sequences[-1] + 1, (self.sequences[-1], response.sequence)
                self.index.apply(events_of(response))
                self.sequences.append(response.sequence)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=5)


def random_request(
    rng: random.Random, stems: list[list[int]], bos: int, own_tokens: int, max_new: int
) -> pb.GenerateStreamRequest:
    """A prompt of a random length of one of a few stems and 4 to `own_tokens` - 1 tokens of its own (many prompts share
    blocks), greedy, 1 to `max_new` - 1 new tokens."""
    stem = rng.choice(stems)
    shared = stem[: rng.randrange(len(stem) + 1)]
    tokens = [bos, *shared, *(rng.randrange(300, 4000) for _ in range(rng.randrange(4, own_tokens)))]
    return pb.GenerateStreamRequest(
        prompt_token_ids=pb.TokenIds(ids=tokens), sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=rng.randrange(1, max_new), ignore_eos=True),
    )
