"""The gauges autoscalers and inference-aware routers read (the Gateway API Inference
Extension's model-server protocol), scraped from a real server's Prometheus endpoint under load."""

from __future__ import annotations

import concurrent.futures
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.faults import StepGate
from tests.harness.helpers import greedy, wait_for
from tests.harness.proxies import free_port
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

QUEUED = "tokenspout_num_requests_waiting"
RUNNING = "tokenspout_num_requests_running"
CACHE = "tokenspout_kv_cache_usage_perc"


def scrape(port: int) -> dict[str, tuple[str, float]]:
    """Metric name -> (type, value) for the unlabelled series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = text_string_to_metric_families(text)
    return {family.name: (family.type, family.samples[0].value) for family in families if family.samples}


def test_queued_running_and_cache_gauges_follow_the_load(tmp_path):
    port = free_port()
    # The fake engine behind a step gate: the load lasts while the gauges are read, however slowly.
    gate = StepGate(tmp_path / "steps")
    gate.hold_at(0)
    server = start_server(tmp_path, "--max-batch-size", "2", "--context-length", "256", "--prometheus-port", str(port),
                          faults=("--step-s", "0.01", "--step-gate", str(gate.path)), fake_engine=True)
    try:
        idle = scrape(port)
        assert {name: idle[name] for name in (QUEUED, RUNNING)} == {QUEUED: ("gauge", 0.0), RUNNING: ("gauge", 0.0)}
        assert idle[CACHE][0] == "gauge"
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = greedy("Write a long story about the sea.", max_new_tokens=96, ignore_eos=True)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(lambda: list(stub.GenerateStream(request, timeout=120))) for _ in range(4)]
                wait_for(lambda: scrape(port)[QUEUED][1] == 4, 60, "the four to queue at the held engine")
                # Two slots: two streams run, two wait (the engine stops after the step that admitted them).
                gate.hold_at(1)
                busy = wait_for(lambda: (now := scrape(port))[QUEUED][1] == now[RUNNING][1] == 2 and now, 60,
                                "two running and two queued")
                assert 0 < busy[CACHE][1] <= 1
                gate.open()
                for stream in streams:
                    assert stream.result()[-1].generated_tokens == 96
        done = scrape(port)
        assert done[QUEUED][1] == done[RUNNING][1] == 0
        assert 0 <= done[CACHE][1] <= 1
    finally:
        assert stop_server(server) == 0
