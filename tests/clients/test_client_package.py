"""tokenspout-client installs alone: a fresh venv gets the client and what its three dependencies
need, never the server (no llama-cpp-python, no numpy)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from tests.harness.servers import REPORT, ROOT

CLIENT = ROOT / "clients" / "python"
DEPENDENCIES = {"grpcio", "protobuf", "googleapis-common-protos"}
# The installed packages, and for each the names it requires (extras aside), read in the fresh venv.
PROBE = """
import importlib.metadata as m, json, re
print(json.dumps({d.metadata["Name"].lower().replace("_", "-"): sorted(
    re.split(r"[ ;<>=!~\\[(]", r, maxsplit=1)[0].lower().replace("_", "-")
    for r in d.requires or () if "extra ==" not in r) for d in m.distributions()}))
"""


def pip(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_the_client_package_installs_into_a_fresh_venv_without_the_server(tmp_path, server):
    started = time.monotonic()
    source = tmp_path / "source"  # a copy: setuptools leaves build/ beside the sources it builds
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    built = pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", tmp_path / "wheel", source)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("tokenspout_client-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = pip("--python", python, "install", "--quiet", wheel)  # its real dependencies, from the index
    assert installed.returncode == 0, installed.stderr
    REPORT.append(f"tokenspout-client: wheel, fresh venv and install in {time.monotonic() - started:.1f} s")

    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True, cwd=tmp_path)
    requires = json.loads(probe.stdout)
    assert set(requires["tokenspout-client"]) == DEPENDENCIES
    closure, todo = set(), ["tokenspout-client"]
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo += requires[name]
    assert set(requires) == closure  # nothing installed beyond what the client needs
    assert not {"tokenspout", "llama-cpp-python", "numpy"} & set(requires)
    server_side = subprocess.run([python, "-c", "import service"], capture_output=True, cwd=tmp_path)
    assert server_side.returncode != 0  # the server's code is not in the client package

    info = subprocess.run(
        [venv / "bin" / "tokenspout-client", "--address", server.address, "--json", "info"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["model"]["engine"] == "llama.cpp"
