"""The GPU check's gRPC checks, run here against the llama.cpp engine so they cannot rot
unnoticed between sessions that have a GPU (bench/gpu/check.py)."""

from __future__ import annotations

import importlib.util

from conftest import ROOT


def load_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_checks_pass_against_the_llama_cpp_engine(stub):
    checks = load_check_module().Checks
    results = checks(stub, expect_exllamav2=False).run_all()
    assert [r["check"] for r in results] == list(checks.NAMES)
    assert [r["check"] for r in results if not r["ok"]] == [], results
    assert [r["check"] for r in results if r["skipped"]] == ["over_budget_is_out_of_range"]  # exllamav2's own


def test_the_gpu_checks_fail_an_engine_that_is_not_exllamav2(stub):
    import pytest

    with pytest.raises(AssertionError, match="llama.cpp"):
        load_check_module().Checks(stub, expect_exllamav2=True).model_info()
