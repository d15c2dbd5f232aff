"""Every benchmark of the suite runs: `python -m bench NAME --smoke` (its smoke flags: a run of seconds) against
the real model, and llama-server where it compares with it, writes a result that the report renders."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import suite
from bench.harness.record import ROOT, load
from bench.report.render import render


@pytest.fixture(scope="session")
def llama_server() -> str:
    """The reference's binary: `make test` builds it and names it in TOKENSPOUT_LLAMA_SERVER."""
    from bench.__main__ import llama_server

    return llama_server()


@pytest.mark.parametrize("name", suite.names())
def test_the_benchmark_runs_and_its_result_renders(name, model_path, llama_server, tmp_path):
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "bench", name, "--smoke", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "TOKENSPOUT_LLAMA_SERVER": llama_server}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = load(out)
    assert result.benchmark == name and result.command.startswith(f"python -m bench {name}")
    assert result.tables and all(table.rows for table in result.tables), "a smoke run still measures something"
    page, _ = render([result])
    assert f"python -m bench {name}" in " ".join(page.split())  # as read: a long command may wrap
