"""The GPU check (bench/gpu/), kept from rotting between sessions that have a GPU.

Here: check.py's gRPC checks against the llama.cpp engine (and three of them against a server
with the mistakes they are there to catch), its report that keeps every step's result, its server stop that kills, and run.sh's stages, limits, report and archive with nothing
there to use (seconds). The full CPU rehearsal in a Python 3.12 environment like the GPU machine's
(bench/gpu/rehearse.sh: ~4 GB of wheels and a prebuilt extension first) runs with
TOKENSPOUT_GPU_REHEARSAL=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile

import grpc
import pytest

from tests.harness.servers import ROOT, start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

STAGES = [
    "preflight", "wheels", "imports", "extension", "jit_build", "tiny_model", "model_check",
    "serve_fp16", "serve_gptq", "convert_exl2", "serve_exl2", "speculation",
]


def gpu_here() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def load_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", ROOT / "bench" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_check_module():
    return load_module("check")


def test_the_gpu_checks_pass_against_the_llama_cpp_engine(stub):
    checks = load_check_module().Checks
    results = checks(stub, expect_exllamav2=False).run_all()
    assert [r["check"] for r in results] == list(checks.NAMES)
    assert [r["check"] for r in results if not r["ok"]] == [], results
    assert [r["check"] for r in results if r["skipped"]] == ["over_budget_is_out_of_range"]  # exllamav2's own


def test_the_gpu_checks_fail_an_engine_that_is_not_exllamav2(stub):
    with pytest.raises(AssertionError, match="llama.cpp"):
        load_check_module().Checks(stub, expect_exllamav2=True).model_info()


class WithTheOldMistakes:
    """The server as the exllamav2 engine served it before issue 26: a stream ending at a stop token
    or EOS lost the tokens it still held, and include_stop_sequence was ignored."""

    def __init__(self, stub) -> None:
        self._stub = stub

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    def GenerateStream(self, request, **kwargs):
        from tokenspout.v1 import generation_pb2 as pb

        request = type(request).FromString(request.SerializeToString())
        request.stopping.ClearField("include_stop_sequence")
        messages = list(self._stub.GenerateStream(request, **kwargs))
        if messages[-1].finish.reason in (pb.FINISH_REASON_STOP_TOKEN, pb.FINISH_REASON_EOS_TOKEN):
            del messages[-1].tokens[:]
        return iter(messages)


def test_the_gpu_checks_fail_the_mistakes_they_are_there_to_catch(stub, tmp_path):
    checks = load_check_module().Checks(WithTheOldMistakes(stub), expect_exllamav2=False)
    with pytest.raises(AssertionError, match=r"\('eos', 0, 1, 1\)"):  # EOS counted, not delivered
        checks.token_ids_add_up_at_every_finish()
    with pytest.raises(AssertionError):
        checks.include_stop_sequence_keeps_it()
    forging = start_server(tmp_path, "--special-tokens-in-chat-content")  # chat content's special text as tokens
    try:
        with grpc.insecure_channel(forging.address) as channel:
            opted_in = load_check_module().Checks(pb_grpc.GenerationServiceStub(channel), expect_exllamav2=False)
            with pytest.raises(AssertionError, match="special-token text became tokens"):
                opted_in.chat_content_stays_text()
    finally:
        stop_server(forging)


def test_checks_left_without_time_are_reported_as_not_run(stub):
    check = load_check_module()
    seen = []
    results = check.Checks(stub, expect_exllamav2=False).run_all(seconds_left=lambda: 1.0, on_result=seen.append)
    assert seen == results and len(results) == len(check.Checks.NAMES)
    assert all(not r["ok"] and r["detail"].startswith("not run") for r in results)


def test_a_late_error_keeps_the_results_before_it(tmp_path):
    report = load_check_module().Report("fp16", str(tmp_path / "check-fp16.json"))
    report.add_check({"check": "streams_incrementally", "ok": True, "skipped": False, "detail": "fine"})
    assert report.step("gRPC rate", lambda: 1 / 0) is None
    assert report.step("direct rate", lambda: 42.0) == 42.0
    on_disk = json.loads((tmp_path / "check-fp16.json").read_text())
    assert [c["check"] for c in on_disk["checks"]] == ["streams_incrementally"]
    assert on_disk["errors"] == ["gRPC rate: ZeroDivisionError: division by zero"]


def test_the_transformers_reference_passes_only_equal_tokens_or_a_parting_at_a_near_tie():
    check = load_check_module()
    reference, wide = list(range(16)), [0.5] * 16
    assert check.compare_greedy(reference, reference, wide)[0]
    parted = reference[:5] + [99] * 11
    assert not check.compare_greedy(parted, reference, wide)[0]  # a clear preference, not followed
    near_tie = wide[:5] + [0.01] + wide[6:]
    ok, detail = check.compare_greedy(parted, reference, near_tie)
    assert ok and "part at step 5" in detail
    assert not check.compare_greedy(reference[:15], reference, wide)[0]  # one token short


def test_a_server_that_ignores_sigterm_is_killed(tmp_path):
    ignores_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", ignores_term], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "up"  # the handler is in place

    class Server:
        pass

    server = Server()
    server.process = process
    assert load_check_module().stop_or_kill(server, grace_s=1) == -9


def test_the_summary_reports_missing_and_cut_short_variant_reports(tmp_path):
    report = load_module("report")
    stages = tmp_path / "stages.tsv"
    stages.write_text("preflight\tok\t3\tfine\nserve_fp16\tTIMEOUT\t180\tkilled\nserve_gptq\tSKIP\t0\tno GPU\n")
    (tmp_path / "check-gptq.json").write_text('{"variant": "gptq", "checks": [{"check": "chat", "ok": tr')
    passed = tmp_path / "check-exl2.json"
    passed.write_text(json.dumps({"variant": "exl2", "checks": [{"check": "chat", "ok": True}], "grpc_tok_s": 10.0}))
    stage_rows = report.read_stages(stages)
    names = ("check-fp16.json", "check-gptq.json", "check-exl2.json")
    variants = [report.read_variant(tmp_path / name) for name in names]
    assert [v["variant"] for v in variants] == ["fp16", "gptq", "exl2"]
    assert [bool(v["errors"]) for v in variants[:2]] == [True, True] and "errors" not in variants[2]
    assert report.failed(stage_rows, variants)
    assert not report.failed([["serve_gptq", "SKIP", "0", "no GPU"]], [variants[2]])
    assert report.failed([["tiny_model", "SKIP", "0", "no time left in the 540s budget"]], [])
    text = "\n".join(report.variant_lines(variants))
    assert "no readable report" in text and "10.0" in text
    drafted = {"variant": "speculation-exl2", "checks": [{"check": "speculation", "ok": True}],
               "speculation": {"ratio_1": 1.5, "ratio_4": 0.9, "draft_tokens": 40, "accepted_draft_tokens": 30}}
    assert "1.50x at 1 stream, 0.90x at 4; 30 of 40 drafts accepted" in "\n".join(report.variant_lines([drafted]))


def run_gpu_check(tmp_path, **env) -> tuple[int, str, dict[str, list[str]]]:
    """run.sh here, with nothing to use (no wheels, no prebuilt, no GPU): its exit, output and stage table."""
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "run.sh")],
        env={
            **os.environ,
            "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
            "WHEELS": str(tmp_path / "no-wheels"), "PREBUILT": str(tmp_path / "no-prebuilt"), **env,
        },
        capture_output=True, text=True, timeout=240,
    )
    rows = (tmp_path / "work" / "report" / "stages.tsv").read_text().splitlines()
    table = {row.split("\t")[0]: row.split("\t")[1:] for row in rows}
    return done.returncode, done.stdout + done.stderr, table


@pytest.mark.skipif(gpu_here(), reason="a GPU is here: run.sh would serve on it")
def test_run_sh_reports_every_stage_packs_everything_and_cuts_a_hang(tmp_path):
    rc, output, table = run_gpu_check(tmp_path, GPU_CHECK_HANG="wheels")
    assert rc == 1, output
    assert list(table) == STAGES
    assert table["preflight"][0] in ("ok", "FAIL")  # a real finding either way, in its own row
    assert table["wheels"][0] == "TIMEOUT" and "killed at its 3s limit" in table["wheels"][2]  # the hang was cut
    assert table["imports"] == table["extension"] == ["SKIP", "0", "needs wheels (TIMEOUT)"]
    assert table["model_check"] == ["SKIP", "0", "needs tiny_model (SKIP)"]
    assert all(table[s] == ["SKIP", "0", "no GPU (nvidia-smi -L fails)"] for s in STAGES[7:])
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-report.tar.gz", "preflight.txt", "run.log", "summary.txt"]
    preflight = (out / "preflight.txt").read_text().splitlines()
    assert [line.split()[0] for line in preflight[:3]] == ["python", "gcc", "nvcc"]  # versions first
    assert preflight[-1].startswith("verdict"), preflight
    with tarfile.open(out / "gpu-report.tar.gz") as archive:
        names = set(archive.getnames())
    expected = {"stages.tsv", "summary.txt", "run.log", "preflight.txt", "preflight.log", "wheels.log"}
    assert {f"report/{name}" for name in expected} <= names
    summary = (out / "summary.txt").read_text()
    assert "result: FAILED" in summary and all(stage in summary for stage in STAGES)
    assert "stage wheels: TIMEOUT" in (out / "run.log").read_text()


def test_run_sh_runs_the_next_stage_after_a_failure(tmp_path):
    rc, output, table = run_gpu_check(tmp_path, GPU_CHECK_FAIL="preflight")
    assert rc == 1, output
    assert table["preflight"][0] == "FAIL" and "simulated failure of preflight" in table["preflight"][2]
    assert table["wheels"][0] == "FAIL" and "no wheels in" in table["wheels"][2]  # it ran, and found none


def test_run_sh_stages_past_the_budget_are_skipped_and_fail_the_run(tmp_path):
    rc, output, table = run_gpu_check(tmp_path, GPU_CHECK_BUDGET_S="19")  # 4 s after the packing reserve
    assert rc == 1, output
    assert table["preflight"][0] == "SKIP" and table["preflight"][2].startswith("no time left"), table
    assert "result: FAILED" in (tmp_path / "out" / "summary.txt").read_text()


@pytest.mark.skipif(os.environ.get("TOKENSPOUT_GPU_REHEARSAL") != "1", reason="set TOKENSPOUT_GPU_REHEARSAL=1 (~16 min)")
def test_the_cpu_rehearsal_passes():
    rehearse = ROOT / "bench" / "gpu" / "rehearse.sh"
    done = subprocess.run(["bash", str(rehearse)], capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "rehearsal: 0 failed" in done.stdout
