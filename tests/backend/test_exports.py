"""The packages' lazy exports (backend.lazy): every exported name resolves to what its module defines, and a
process that only reads settings, as the supervisor does, loads nothing heavy."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import backend
import backend.constraints
from backend.lazy import homes
from tests.harness.servers import ROOT

HEAVY = ("numpy", "llguidance", "llama_cpp", "grpc", "jinja2", "zmq", "opentelemetry")


@pytest.mark.parametrize("package", [backend, backend.constraints], ids=lambda p: p.__name__)
def test_every_export_resolves_to_its_modules_own(package):
    imported = homes(package.__file__)
    assert set(imported) <= set(package.__all__)
    for name in package.__all__:
        value = getattr(package, name)
        assert name not in imported or value is getattr(importlib.import_module(imported[name]), name), name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'not_exported'"):
        package.not_exported  # noqa: B018


def test_backend_setting_is_the_function_even_once_its_module_is_imported():
    import backend.setting  # noqa: F401  # the import system sets the package's attribute to the module

    assert callable(backend.setting) and backend.setting.__module__ == "backend.setting"


def test_the_supervisor_loads_no_heavy_library():
    """What `tokenspout serve` imports before it starts its children: settings, the supervisor, the startup lines."""
    code = ("import sys, service.cli, service.supervisor, service.startup\n"
            "from service.config import load_config\n"
            "load_config({}, config_file=None)\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
