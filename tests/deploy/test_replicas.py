"""Three replicas behind a real L7 proxy (HAProxy, deploy/haproxy/haproxy.cfg), and behind
gRPC's own round_robin with health checking (deploy/grpc-service-config.json), on loopback.

Each scenario: 24 concurrent streams spread over all three replicas; SIGTERM one of them
mid-load (its streams finish, new calls go to the others, no call fails); then kill -9 a
second one mid-load (only the streams it was serving fail: UNAVAILABLE when the client was
connected to it, UNKNOWN through HAProxy; the next calls succeed on the last replica).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import signal
import socket
import threading
import time

import grpc
import pytest

from tests.harness.helpers import greedy
from tests.harness.proxies import HAProxy, grpc_request, requests_finished, service_config, start_replicas, stop_replicas
from tests.harness.servers import REPORT
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

STREAMS = 24


class Load:
    """Concurrent greedy streams, each recording its outcome: "ok" or the status code's name."""

    def __init__(self, stub: pb_grpc.GenerationServiceStub, prefix: str, count: int, tokens: int) -> None:
        self.ids = [f"{prefix}-{i}" for i in range(count)]
        self.tokens = tokens
        self._stub = stub
        self.details: dict[str, str] = {}
        self._started = threading.Semaphore(0)
        self._pool = concurrent.futures.ThreadPoolExecutor(count)
        self._futures = {request_id: self._pool.submit(self._run, request_id) for request_id in self.ids}

    def _run(self, request_id: str) -> str:
        request = greedy("Write a long story about the sea.", max_new_tokens=self.tokens, ignore_eos=True)
        request.request_id = request_id
        started, last = False, None
        try:
            for message in self._stub.GenerateStream(request, timeout=300):
                last = message
                if not started:
                    started = True
                    self._started.release()
        except grpc.RpcError as error:
            self.details[request_id] = error.details()
            return error.code().name
        finally:
            if not started:
                self._started.release()
        return "ok" if last.generated_tokens == self.tokens else f"short: {last.generated_tokens}"

    def wait_until_streaming(self) -> None:
        """Until every stream has its first message (or has ended)."""
        for _ in self.ids:
            assert self._started.acquire(timeout=300)

    def outcomes(self) -> dict[str, str]:
        results = {request_id: future.result(timeout=400) for request_id, future in self._futures.items()}
        self._pool.shutdown()
        return results


def _spread_then_sigterm(stub, replicas) -> None:
    """24 streams over three replicas; SIGTERM the second while they run."""
    first, draining, third = replicas
    load = Load(stub, "spread", STREAMS, tokens=16)
    load.wait_until_streaming()
    draining.process.send_signal(signal.SIGTERM)
    draining.wait_until_draining()
    after = Load(stub, "after-sigterm", 6, tokens=4)
    outcomes = {**load.outcomes(), **after.outcomes()}
    assert set(outcomes.values()) == {"ok"}, {**load.details, **after.details}
    assert draining.process.wait(timeout=60) == 0, draining.log()
    served = {name: requests_finished(r) & set(load.ids) for name, r in zip("ABC", replicas)}
    REPORT.append("replicas: 24 streams served " + ", ".join(f"{n}={len(ids)}" for n, ids in served.items()))
    assert all(len(ids) >= 4 for ids in served.values()), served  # spread, and B's streams finished
    assert set().union(*served.values()) == set(load.ids)
    # New calls went to the other two replicas; the draining one served none of them.
    assert not requests_finished(draining) & set(after.ids)
    assert requests_finished(first) | requests_finished(third) >= set(after.ids)


def _kill_mid_load(stub, survivor, victim, cut: str) -> None:
    """kill -9 a replica mid-load: its streams fail with status `cut`, the others finish."""
    load = Load(stub, "kill", 12, tokens=24)
    load.wait_until_streaming()
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait(timeout=10)
    outcomes = load.outcomes()
    survived = requests_finished(survivor) & set(load.ids)
    failed = {request_id: code for request_id, code in outcomes.items() if code != "ok"}
    REPORT.append(f"replicas: kill -9 mid-load: {len(failed)} of {len(load.ids)} streams failed: {sorted(set(failed.values()))}")
    assert failed and set(failed.values()) == {cut}, outcomes
    assert survived == set(load.ids) - set(failed), "a stream the survivor served failed, or one went missing"
    after = Load(stub, "after-kill", 6, tokens=4)
    assert set(after.outcomes().values()) == {"ok"}
    assert requests_finished(survivor) >= set(after.ids)


@pytest.fixture
def replicas(tmp_path, model_path):
    running = start_replicas(tmp_path, 3, "--grace-period-s", "300")
    yield running
    stop_replicas(running)


def test_behind_haproxy(replicas, tmp_path):
    proxy = HAProxy(tmp_path, [r.address for r in replicas])
    try:
        options = [("grpc.service_config", service_config(client_side=False))]
        with grpc.insecure_channel(proxy.address, options=options) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            _spread_then_sigterm(stub, replicas)
            # HAProxy's gRPC health check took the drained replica out.
            proxy.wait_for(lambda states: states == {"replica1": True, "replica2": False, "replica3": True})
            # HAProxy 2.6 ends a stream whose replica vanished with a plain END_STREAM, no gRPC
            # trailers, which gRPC reports as UNKNOWN ("Stream removed"); see deploy/README.md.
            _kill_mid_load(stub, replicas[0], replicas[2], cut="UNKNOWN")
    finally:
        proxy.stop()


def _until_every_replica_serves(stub, replicas) -> None:
    """round_robin uses a replica once its connection is up and its health watch says SERVING;
    one-token calls until each has served one, so the load starts with all three in rotation."""
    deadline = time.monotonic() + 60
    for i in itertools.count():
        if all(any(r.startswith("warm-") for r in requests_finished(replica)) for replica in replicas):
            return
        assert time.monotonic() < deadline, "a replica never joined the rotation"
        request = greedy("Hi", max_new_tokens=1)
        request.request_id = f"warm-{i}"
        list(stub.GenerateStream(request, timeout=60))


def test_client_side_round_robin_with_health_checks(replicas):
    target = "ipv4:" + ",".join(r.address for r in replicas)
    options = [("grpc.service_config", service_config(client_side=True))]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        _until_every_replica_serves(stub, replicas)
        _spread_then_sigterm(stub, replicas)
        _kill_mid_load(stub, replicas[0], replicas[2], cut="UNAVAILABLE")


def test_haproxy_passes_deadlines_and_idles_out_nothing_that_streams(tmp_path, model_path):
    """HAProxy with 1 s idle timeouts: a stream of several seconds of tokens is not cut, and a
    caller's grpc-timeout reaches the replica, which ends the stream itself at that deadline."""
    (replica,) = start_replicas(tmp_path, 1)
    proxy = HAProxy(tmp_path, [replica.address], idle_timeout="1s")
    try:
        with grpc.insecure_channel(proxy.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = greedy("Write a long story about the sea.", max_new_tokens=160, ignore_eos=True)
            start = time.monotonic()
            messages = list(stub.GenerateStream(request, timeout=300))
            lasted = time.monotonic() - start
        assert messages[-1].generated_tokens == 160
        REPORT.append(f"replicas: a {lasted:.1f} s stream through HAProxy with a 1 s idle timeout")
        assert lasted > 1.0, "the stream must outlast the idle timeout to show anything"
        # A raw HTTP/2 caller that sends grpc-timeout but never cancels: only the replica can
        # end this stream at the deadline (a gRPC client would cancel it itself, racing it).
        request = greedy("Write a long story about the sea.", max_new_tokens=400, ignore_eos=True)
        request.request_id = "with-deadline"
        call = grpc_request(
            "/tokenspout.v1.GenerationService/GenerateStream", request.SerializeToString(), "tokenspout",
            ("grpc-timeout", "1S"),
        )
        # On a busy machine a health check may have timed out during the long stream: wait until
        # HAProxy counts the replica up again, or it answers 503 itself and the replica sees nothing.
        proxy.wait_for(lambda states: all(states.values()))
        with socket.create_connection(("127.0.0.1", proxy.port)) as raw:
            raw.sendall(call)
            # The engine's own deadline check or gRPC's, whichever fires first, ends it at the deadline;
            # either way the call fails with DEADLINE_EXCEEDED (test_lifecycle proves the engine's).
            replica.wait_for_log("request with-deadline ended by the caller: time_limit", timeout_s=60)
    finally:
        proxy.stop()
        stop_replicas([replica])
