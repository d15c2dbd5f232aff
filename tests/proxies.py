"""Several tokenspout replicas and the shipped HAProxy config in front of them, on loopback.

tests/test_replicas.py and bench/replicas.py share this.
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

from conftest import ROOT, RunningServer, start_server, stop_server

sys.path.insert(0, str(ROOT / "deploy" / "haproxy"))
from grpc_health_check import grpc_request  # noqa: E402  (raw HTTP/2 gRPC calls, for tests)

HAPROXY_CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited:\n{self.log_path.read_text()}")
            try:
                states = self.server_states()
                if condition(states):
                    return states
            except OSError:
                pass  # the socket is not there yet
            time.sleep(0.1)
        raise AssertionError(f"haproxy never reached the expected state:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def requests_finished(replica: RunningServer) -> set[str]:
    """Ids of the requests a replica streamed to the end, from its log."""
    return set(re.findall(r"request (\S+) finished", replica.log()))
