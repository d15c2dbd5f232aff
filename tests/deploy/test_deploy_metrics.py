"""The gauges autoscalers and inference-aware routers read (the Gateway API Inference
Extension's model-server protocol), scraped from a real server's Prometheus endpoint under load."""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import socket
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.config import ServeConfig
from tests.harness.faults import StepGate
from tests.harness.helpers import greedy, wait_for
from tests.harness.proxies import free_port
from tests.harness.servers import ROOT, start_server, stop_server
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


OPERATIONS = ROOT / "docs" / "operations.md"
MODEL_OPERATION = {"gen_ai_request_model", "gen_ai_operation_name", "gen_ai_provider_name", "tokenspout_attention_provider"}
"""What the metrics table's "model, operation" stands for."""


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """docs/operations.md's metrics table: scraped name -> (type, labels as scraped)."""
    rows = re.findall(r"^\| `[\w.]+` \| `(\w+)` \| (\w+) \|([^|]*)\|", OPERATIONS.read_text(), re.MULTILINE)
    found = {}
    for name, kind, labels in rows:
        named = set(re.findall(r"`(\w+)`", labels))
        found[name] = (kind, named | (MODEL_OPERATION if "model, operation" in labels else set()))
    return found


def scraped_metrics(text: str) -> dict[str, tuple[str, set[str]]]:
    """tokenspout's own families as the endpoint writes them: name -> (type, labels but otel_scope_* and le)."""
    families = dict(re.findall(r"^# TYPE ((?:gen_ai|tokenspout)_\w+) (\w+)$", text, re.MULTILINE))
    labels: dict[str, set[str]] = {name: set() for name in families}
    for sample, label_text in re.findall(r"^(\w+)\{(.*)\} ", text, re.MULTILINE):
        family = max((name for name in families if sample.startswith(name)), key=len, default=None)
        if family is not None:
            labels[family] |= {key for key in re.findall(r'(\w+)="', label_text)
                               if not key.startswith("otel_scope_") and key != "le"}
    return {name: (kind, labels[name]) for name, kind in families.items()}


def test_every_scraped_metric_is_documented_as_scraped(tmp_path, model_path):
    """The metrics table names each family as Prometheus scrapes it (suffixes included) with its labels, on the
    real engine (the fake one keeps no per-caller figures and names no attention provider)."""
    port = free_port()
    gate = StepGate(tmp_path / "steps")
    server = start_server(tmp_path, "--max-batch-size", "1", "--max-queued-requests", "0", "--context-length", "256",
                          "--prometheus-port", str(port), faults=("--step-gate", str(gate.path)))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            gate.open()
            assert list(stub.GenerateStream(greedy("Hello", max_new_tokens=4, ignore_eos=True), timeout=60))
            with pytest.raises(grpc.RpcError):  # an error
                stub.Generate(greedy("", max_new_tokens=4), timeout=60)
            gate.hold_at(0)  # no step more: the next request holds the only place
            held = stub.GenerateStream(greedy("Hold on", max_new_tokens=50, ignore_eos=True), timeout=60)
            wait_for(lambda: (now := scrape(port)).get(QUEUED, ("", 0))[1] + now.get(RUNNING, ("", 0))[1] == 1, 60,
                     "the held request to take the only place")
            with pytest.raises(grpc.RpcError) as refused:  # a refusal: the only place is taken
                stub.Generate(greedy("More", max_new_tokens=4), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            busy = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            held.cancel()  # a cancellation
            wait_for(lambda: (now := scrape(port))[QUEUED][1] + now[RUNNING][1] == 0, 60, "the cancelled request to end")
        after = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        gate.open()
        assert stop_server(server) == 0
    scraped = scraped_metrics(busy)
    for name, (kind, labels) in scraped_metrics(after).items():
        scraped[name] = (kind, scraped.get(name, (kind, set()))[1] | labels)
    documented = documented_metrics()
    assert sorted(scraped) == sorted(documented)
    for name, (kind, labels) in scraped.items():
        documented_kind, documented_labels = documented[name]
        assert kind == documented_kind, name
        assert labels == documented_labels, name


def listening_hosts(port: int) -> set[str]:
    """The IPv4 addresses this host listens on at `port`, from the kernel's socket table."""
    hosts = set()
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            hosts.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return hosts


def test_metrics_bind_the_listen_host_unless_told_otherwise(tmp_path):
    """A server listening on loopback kept its metrics on 0.0.0.0; now they follow `listen` by default."""
    for flags, expected in (((), {"127.0.0.1"}), (("--prometheus-host", "0.0.0.0"), {"0.0.0.0"})):
        port = free_port()
        server = start_server(tmp_path, "--prometheus-port", str(port), *flags, fake_engine=True)
        try:
            assert listening_hosts(port) == expected
            assert "tokenspout_num_requests_waiting" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        finally:
            assert stop_server(server) == 0


@pytest.mark.parametrize(("listen", "host", "expected"), [
    ("127.0.0.1:50051", "", "127.0.0.1"), ("[::1]:50051", "", "::1"), ("0.0.0.0:50051", "", "0.0.0.0"),
    (":50051", "", "0.0.0.0"), ("unix:/tmp/tokenspout.sock", "", "127.0.0.1"), ("127.0.0.1:50051", "::", "::"),
])
def test_the_metrics_host_follows_listen(listen, host, expected):
    assert ServeConfig(listen=listen, prometheus_host=host).metrics_host == expected


def test_a_busy_metrics_port_stops_the_start_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "tests.harness.faults", "--fake-engine", "serve", "--listen",
                                 "127.0.0.1:0", "--prometheus-port", str(port)], capture_output=True, text=True,
                                timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    # The engine process may have logged its start before the front end found the port taken.
    assert result.stderr.strip().splitlines()[-1] == (
        f"tokenspout: cannot serve metrics on 127.0.0.1:{port}: Address already in use")
