"""The GPU check's exllamav3 variant (GPU_CHECK_PLAN=exl3 bench/gpu/run.sh, bench/gpu/stages_exl3.sh,
check.py --engine exllamav3), kept from rotting until a session has a GPU: its stages, limits and report with
nothing there to use (seconds), the checks' expectations of an exllamav3 server, and the direct baseline run
through on exllamav3's doubles (tests/harness/exllamav3_fakes.py). bench/gpu/rehearse.sh --exl3 rehearses it in
the GPU machine's Python 3.12 environment (TOKENSPOUT_GPU_REHEARSAL=1)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile

import pytest

from backend.exllamav3 import binding
from bench.gpu import checks
from bench.gpu.rates_exl3 import direct_rates
from tests.bench.test_gpu_check import gpu_here
from tests.harness import exllamav3_fakes as fakes
from tests.harness.exllama_fakes import FakeGenerators
from tests.harness.servers import ROOT

STAGES = ["preflight", "wheels", "imports_exl3", "extension_exl3", "jit_build_exl3", "tiny_model", "binding_exl3",
          "serve_fp16_exl3", "convert_exl3", "serve_exl3", "speculation_exl3"]
GPU_STAGES = ["serve_fp16_exl3", "convert_exl3", "serve_exl3", "speculation_exl3"]


def run_exl3_check(tmp_path, **env) -> tuple[int, str, dict[str, list[str]]]:
    """run.sh's exllamav3 variant here, with nothing to use (no wheels, no prebuilt, no GPU)."""
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "run.sh")],
        env={
            **os.environ, "GPU_CHECK_PLAN": "exl3",
            "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
            "WHEELS": str(tmp_path / "no-wheels"), "PREBUILT": str(tmp_path / "no-prebuilt"), **env,
        },
        capture_output=True, text=True, timeout=240,
    )
    rows = (tmp_path / "work" / "report" / "stages.tsv").read_text().splitlines()
    return done.returncode, done.stdout + done.stderr, {row.split("\t")[0]: row.split("\t")[1:] for row in rows}


@pytest.mark.skipif(gpu_here(), reason="a GPU is here: run.sh would serve on it")
def test_its_stages_run_in_order_and_each_failure_is_reported_the_rest_running(tmp_path):
    rc, output, table = run_exl3_check(tmp_path, GPU_CHECK_HANG="wheels")
    assert rc == 1, output
    assert list(table) == STAGES
    assert table["wheels"][0] == "TIMEOUT" and "killed at its 3s limit" in table["wheels"][2]
    assert table["imports_exl3"] == table["extension_exl3"] == ["SKIP", "0", "needs wheels (TIMEOUT)"]
    assert all(table[s] == ["SKIP", "0", "no GPU (nvidia-smi -L fails)"] for s in GPU_STAGES)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "result: FAILED" in summary and all(stage in summary for stage in STAGES)
    assert "540s budget" in (tmp_path / "out" / "run.log").read_text()  # its own budget, not exllamav2's 330 s


def a_wheel(directory) -> None:
    """A wheel of one empty package, for the wheels stage to install."""
    info = "stand_in-1.0.dist-info"
    files = {
        "stand_in/__init__.py": b"",
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: stand-in\nVersion: 1.0\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(directory / "stand_in-1.0-py3-none-any.whl", "w") as wheel:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            wheel.writestr(name, data)


def test_a_missing_prebuilt_extension_is_named_and_the_jit_build_needs_a_gpu(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    a_wheel(wheels)
    rc, output, table = run_exl3_check(tmp_path, WHEELS=str(wheels), GPU_CHECK_SKIP="preflight,tiny_model")
    assert rc == 1, output
    assert table["wheels"][0] == "ok" and table["imports_exl3"][0] in ("ok", "FAIL")
    assert table["extension_exl3"][0] == "FAIL" and "no prebuilt exllamav3_ext" in table["extension_exl3"][2]
    assert table["jit_build_exl3"] == ["SKIP", "0", "no GPU (nvidia-smi -L fails)"]


def test_the_checks_expect_exllamav3s_samplers_weights_and_name(stub):
    with pytest.raises(AssertionError, match="llama.cpp"):
        checks.Checks(stub, expect_exllamav2=True, engine="exllamav3").model_info()
    assert "exllamav3" in checks.PAGED_PROVIDERS and {"typical_p", "mirostat"}.isdisjoint(checks.SAMPLERS["exllamav3"])
    assert checks.WEIGHTS["exllamav3"] == ("EXL3", "FP16", "BF16")


class Decoding(fakes.FakeGenerator):
    """exllamav3's Generator as the direct baseline drives it: every job samples token 7 to its end, and each
    iterate() costs 2 ms whatever the batch (what batching buys on a GPU)."""

    def enqueue(self, job) -> int:
        self.samples[job.identifier] = [(7, b"x")] * job.max_new_tokens
        return super().enqueue(job)

    def iterate(self) -> list[dict]:
        time.sleep(0.002)
        return super().iterate()

    def num_remaining_jobs(self) -> int:
        return len(self.pending) + len(self.active)


def test_the_direct_baseline_runs_through_on_exllamav3s_doubles(tmp_path, monkeypatch):
    generators = FakeGenerators(Decoding)
    monkeypatch.setattr(binding, "import_classes", lambda: fakes.classes(generators))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64}))
    measured = direct_rates(tmp_path, [[0, 5, 6]] * 16, tokens=24, reps=1)
    assert measured["provider"] == "exllamav3" and measured["paged"] and set(measured["tok_s"]) == {"1", "4", "16"}
    assert measured["tok_s"]["16"] > 2 * measured["tok_s"]["1"] > 0  # sixteen decode in the time of one
    generator = generators[0]
    assert generator.closed and generator._cache.initialized
    assert generator.fields == {"max_batch_size": 16, "max_chunk_size": 2048}
    assert all(job.sampling.names == ["SS_Argmax"] for job in generator.enqueued)


@pytest.mark.skipif(os.environ.get("TOKENSPOUT_GPU_REHEARSAL") != "1", reason="set TOKENSPOUT_GPU_REHEARSAL=1 (~8 min)")
def test_the_cpu_rehearsal_passes():
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "rehearse.sh"), "--exl3"], capture_output=True,
                          text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "rehearsal: 0 failed" in done.stdout
