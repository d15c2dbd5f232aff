"""The engine process's protocol (backend.process), both sides in this process: an EngineHost serving the fake
engine on a thread, RemoteEngines on the test's event loop, raw ZMQ peers where a test plays a front end by
hand. The real processes, their deaths and restarts are tests/service/test_engine_process.py's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import subprocess
import threading
from collections.abc import Iterator

import pytest
import zmq

from backend.constraints import ConstraintError, ConstraintSpec
from backend.events import ErrorEvent, Event, TokenEvent
from backend.process import protocol as wire
from backend.process.host import EngineHost
from backend.process.remote import RemoteEngine
from backend.types import GenerationRequest, SamplingParams, StopParams
from tests.harness.fake_engine import FakeEngine, FakeVocabulary
from tests.harness.helpers import wait_for


class Stream:
    """A request's sink on the loop: its events, and a future done at its last."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ended = asyncio.get_running_loop().create_future()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if (isinstance(event, ErrorEvent) or event.finish is not None) and not self.ended.done():
            self.ended.set_result(event)

    @property
    def text(self) -> str:
        return "".join(event.text for event in self.events if isinstance(event, TokenEvent))


def request(request_id: str, tokens: int = 8, prompt: str = "Hello") -> GenerationRequest:
    return GenerationRequest(request_id, tuple(FakeVocabulary().tokenize(prompt)), SamplingParams(temperature=0.0),
                             StopParams(max_new_tokens=tokens, ignore_eos=True))


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    running = FakeEngine()
    yield running
    running.close()


@pytest.fixture
def host(engine: FakeEngine, tmp_path: pathlib.Path) -> Iterator[EngineHost]:
    served = EngineHost(engine, tmp_path, restarts=2)
    thread = threading.Thread(target=served.serve, daemon=True)
    thread.start()
    yield served
    served.stop_serving()
    thread.join(5)
    served.close()


async def connected(tmp_path: pathlib.Path, index: int = 0) -> RemoteEngine:
    remote = RemoteEngine(tmp_path, index, lambda info: FakeVocabulary())
    await asyncio.wait_for(remote.connect(), 10)
    return remote


async def test_a_front_end_submits_and_its_requests_stream_back_as_in_process(host, tmp_path):
    remote = await connected(tmp_path)
    try:
        assert remote.info.model_id == "fake-bytes" and remote.restarts == 2
        assert remote.tokenize("Hi") == FakeVocabulary().tokenize("Hi")  # the front end's own vocabulary
        streams = {name: Stream() for name in ("a", "b")}
        for name, stream in streams.items():
            remote.submit(request(name), stream)
        for stream in streams.values():
            last = await asyncio.wait_for(stream.ended, 10)
            assert isinstance(last, TokenEvent) and last.finish is not None and last.generated_tokens == 8
        local = FakeEngine()
        try:  # the same events as the engine gives a caller in its own process
            alone, loop = Stream(), asyncio.get_running_loop()
            local.submit(request("a"), lambda event: loop.call_soon_threadsafe(alone, event))
            await asyncio.wait_for(alone.ended, 10)
        finally:
            local.close()
        assert streams["a"].text == alone.text and len(streams["a"].text) == 8
        for name in streams:
            remote.release(name)
        stats = await asyncio.wait_for(remote.current_stats(), 10)
        assert stats.started_total == 2 and stats.engine_restarts == 2 and stats.running_sequences == 0
    finally:
        remote.close()


async def test_cancel_ends_a_request_at_the_next_step_and_release_frees_its_place(host, engine, tmp_path):
    remote = await connected(tmp_path)
    try:
        engine.plan("held", hold_after=1)
        stream = Stream()
        remote.submit(request("held-1", 50), stream)
        while not stream.events:
            await asyncio.sleep(0.01)
        remote.cancel("held-1")
        last = await asyncio.wait_for(stream.ended, 10)
        assert last.finish.reason.value == "cancelled"
        remote.release("held-1")
        stats = await remote.current_stats()
        assert stats.cancelled_total == 1 and stats.running_sequences == 0
    finally:
        remote.close()


async def test_constraints_compile_in_the_engine_and_their_errors_come_back_named(host, tmp_path):
    remote = await connected(tmp_path)
    try:
        spec = ConstraintSpec("regex", "[0-9]{3}")
        first = await remote.compile(spec)
        again = await remote.compile(spec)
        assert not first.cached and again.cached and again.fresh_compile_s == 0.0
        with pytest.raises(ConstraintError) as caught:
            await remote.compile(ConstraintSpec("json_schema", "{not json"))
        assert caught.value.kind == "json_schema" and "not valid JSON" in str(caught.value)
        stream = Stream()
        remote.submit(GenerationRequest("digits", tuple(FakeVocabulary().tokenize("n")), SamplingParams(temperature=0.0),
                                        StopParams(max_new_tokens=8), constraint=spec), stream)
        last = await asyncio.wait_for(stream.ended, 10)  # the fake engine's script is no digits: its grammar refuses it
        assert isinstance(last, ErrorEvent) and last.kind.value == "constraint_failed" and "rejected" in last.message
    finally:
        remote.close()


async def test_two_front_ends_may_use_the_same_request_id(host, tmp_path):
    first, second = await connected(tmp_path, 0), await connected(tmp_path, 1)
    try:
        streams = (Stream(), Stream())
        first.submit(request("same", prompt="one"), streams[0])
        second.submit(request("same", prompt="two"), streams[1])
        for stream in streams:
            await asyncio.wait_for(stream.ended, 10)
        assert streams[0].text != streams[1].text  # each got its own request's output
    finally:
        first.close()
        second.close()


@contextlib.contextmanager
def raw_front_end(run_dir: pathlib.Path, index: int) -> Iterator[tuple[zmq.Socket, zmq.Socket, str]]:
    """A front end played by hand: (the socket it sends on, the one it receives on, that one's address)."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    address = f"ipc://{run_dir / wire.front_end_socket(index)}"
    pull.bind(address)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, wire.front_end_identity(index))
    dealer.connect(f"ipc://{run_dir / wire.ENGINE_SOCKET}")
    try:
        yield dealer, pull, address
    finally:
        dealer.close(linger=0)
        pull.close(linger=0)
        context.term()


def next_of(pull: zmq.Socket, kind: type) -> object:
    """The next message of `kind` (unasked status reports and others may come between)."""
    while not isinstance(message := wire.decode_to_front_end(pull.recv()), kind):
        pass
    return message


def test_a_front_end_that_dies_has_its_requests_cancelled_and_released(host, engine, tmp_path):
    """A raw front end whose pid is a process the test then kills: the engine ends its held request."""
    engine.plan("held", hold_after=1)
    body = subprocess.Popen(["sleep", "60"])
    try:
        with raw_front_end(tmp_path, 5) as (dealer, pull, address):
            dealer.send(wire.encode(wire.Hello(5, body.pid, address)))
            next_of(pull, wire.Welcome)
            dealer.send(b"\x93not a message")  # unreadable: dropped, nothing else
            dealer.send(wire.encode(wire.Submit(request("held-by-the-dead", 50))))
            assert next_of(pull, wire.Events).events[0][0] == "held-by-the-dead"
            body.kill()
            body.wait()
            wait_for(lambda: engine.stats.cancelled_total == 1 and engine.stats.running_sequences == 0, 30, "the cancel")
    finally:
        body.kill()


def test_a_front_end_speaking_another_protocol_version_is_not_served(host, tmp_path):
    """Its Hello is ignored, so its next command is dropped: the first status it gets answers the one it asks after
    its Hello in this version (the engine reads one peer's messages in order)."""
    with raw_front_end(tmp_path, 7) as (dealer, pull, address):
        dealer.send(wire.encode(wire.Hello(7, os.getpid(), address, version=wire.VERSION + 1)))
        dealer.send(wire.encode(wire.Status(1)))
        dealer.send(wire.encode(wire.Hello(7, os.getpid(), address)))
        dealer.send(wire.encode(wire.Status(2)))
        next_of(pull, wire.Welcome)
        answer = next_of(pull, wire.StatusReport)
        while not answer.ticket:  # unasked reports carry ticket 0
            answer = next_of(pull, wire.StatusReport)
        assert answer.ticket == 2


async def test_peers_that_are_no_front_end_are_dropped_and_the_engine_serves_on(host, tmp_path):
    """A peer with an identity of its own, or none, and frames of any shape: each message dropped (and logged)."""
    context = zmq.Context()
    strangers = [context.socket(zmq.DEALER) for _ in range(2)]
    strangers[0].setsockopt(zmq.IDENTITY, b"stranger")
    try:
        for stranger in strangers:
            stranger.connect(f"ipc://{tmp_path / wire.ENGINE_SOCKET}")
            stranger.send(wire.encode(wire.Submit(request("intruder"))))
            stranger.send_multipart([b"two", b"frames"])
            stranger.send(wire.encode(wire.Release("intruder")))
        remote = await connected(tmp_path)
        try:
            stream = Stream()
            remote.submit(request("after"), stream)
            last = await asyncio.wait_for(stream.ended, 10)
            assert last.finish is not None
            stats = await remote.current_stats()
            assert stats.started_total == 1  # the strangers' submits never reached the engine
        finally:
            remote.close()
    finally:
        for stranger in strangers:
            stranger.close(linger=0)
        context.term()
