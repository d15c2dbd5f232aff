"""The GPU check (bench/gpu/), kept from rotting between sessions that have a GPU.

Here: check.py's gRPC checks against the llama.cpp engine (and three of them against a server
with the mistakes they are there to catch), its report that keeps every step's result, its server stop that kills, and
run.sh's stages, limits, report and archive with nothing
there to use (seconds); paged_smoke.py and check.py's direct baseline run through on a fake of
exllamav2 0.3.2 (CPU), and the decode-rate measure and the summary on made-up figures. The full CPU rehearsal in a
Python 3.12 environment like the GPU machine's
(bench/gpu/rehearse.sh: ~4 GB of wheels and a prebuilt extension first) runs with
TOKENSPOUT_GPU_REHEARSAL=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time
import types

import grpc
import pytest

from bench.gpu import checks, rates
from tests.harness.servers import ROOT, start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

STAGES = [
    "preflight", "wheels", "imports", "extension", "jit_build", "provider", "tiny_model", "paged_smoke", "serve_gptq",
    "convert_exl2", "paged_smoke_exl2", "serve_exl2", "model_check", "serve_fp16", "speculation",
]
GPU_STAGES = ["paged_smoke", "serve_gptq", "convert_exl2", "paged_smoke_exl2", "serve_exl2", "serve_fp16", "speculation"]


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
    results = checks.Checks(stub, expect_exllamav2=False).run_all()
    assert [r["check"] for r in results] == list(checks.Checks.NAMES)
    assert [r["check"] for r in results if not r["ok"]] == [], results
    assert [r["check"] for r in results if r["skipped"]] == ["over_budget_is_out_of_range"]  # exllamav2's own


def test_the_gpu_checks_fail_an_engine_that_is_not_exllamav2(stub):
    with pytest.raises(AssertionError, match="llama.cpp"):
        checks.Checks(stub, expect_exllamav2=True).model_info()


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
    mistaken = checks.Checks(WithTheOldMistakes(stub), expect_exllamav2=False)
    with pytest.raises(AssertionError, match=r"\('eos', 0, 1, 1\)"):  # EOS counted, not delivered
        mistaken.token_ids_add_up_at_every_finish()
    with pytest.raises(AssertionError):
        mistaken.include_stop_sequence_keeps_it()
    forging = start_server(tmp_path, "--special-tokens-in-chat-content")  # chat content's special text as tokens
    try:
        with grpc.insecure_channel(forging.address) as channel:
            opted_in = checks.Checks(pb_grpc.GenerationServiceStub(channel), expect_exllamav2=False)
            with pytest.raises(AssertionError, match="special-token text became tokens"):
                opted_in.chat_content_stays_text()
    finally:
        stop_server(forging)


def test_checks_left_without_time_are_reported_as_not_run(stub):
    seen = []
    results = checks.Checks(stub, expect_exllamav2=False).run_all(seconds_left=lambda: 1.0, on_result=seen.append)
    assert seen == results and len(results) == len(checks.Checks.NAMES)
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


def test_the_paged_smoke_self_check_passes_without_torch():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "paged_smoke.py"), "--self-check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "self-check: ok" in done.stdout, done.stdout + done.stderr


def test_decode_rates_count_the_time_every_stream_was_decoding():
    window_rate = rates.window_rate
    assert window_rate([[(0.0, 1), (1.0, 101)]]) == 100  # one stream: tokens after the first, over their time
    early = [(0.0, 1)] + [(0.01 * i, 1 + i) for i in range(1, 101)]
    late = [(t + 0.1, n) for t, n in early]  # started 10 steps later: only the overlap counts
    assert window_rate([early, late]) == pytest.approx(200)
    in_turn = [[(0.0, 1), (1.0, 101)], [(1.0, 1), (2.0, 101)]]  # unpaged: one after the other
    assert window_rate(in_turn) == pytest.approx(100)
    with pytest.raises(ValueError, match="at once"):
        window_rate([[(0.0, 8)]])


def test_the_attention_provider_decides_what_counts_as_paged_and_what_the_baseline_imports():
    check = load_check_module()
    from tokenspout.v1 import generation_pb2 as pb

    paged = pb.GetModelInfoResponse(engine="exllamav2", limits=pb.Limits(max_batch_size=16))
    unpaged = pb.GetModelInfoResponse(engine="exllamav2 (unpaged: one request at a time)", limits=pb.Limits(max_batch_size=1))
    assert checks.attention_provider(paged) == "unknown"  # not said (or a proto without the field)
    if "attention_provider" in pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name:
        assert checks.attention_provider(pb.GetModelInfoResponse(attention_provider="sdpa")) == "sdpa"
    assert checks.runs_paged(paged, "unknown") and not checks.runs_paged(unpaged, "unknown")
    assert checks.runs_paged(unpaged, "sdpa") and not checks.runs_paged(paged, "none")
    assert [check.direct_setting(p, True) for p in ("sdpa", "flash-attn", "none", "unknown")] == [
        "sdpa", "flash-attn", "off", "auto"]
    assert check.direct_setting("unknown", False) == "off"
    table = rates.rate_table({"1": 97.0, "16": 900.0}, {"1": 100.0, "16": 1000.0})
    assert table["ratio"] == pytest.approx({"1": 0.97, "16": 0.9}) and table["below_target"] == [16]


def test_the_summary_shows_each_variant_paged_its_provider_smoke_and_rates(tmp_path):
    report = load_module("report")
    smoke = tmp_path / "smoke-fp16-gptq.json"
    smoke.write_text(json.dumps({"kind": "paged_smoke", "ok": False, "errors": [], "models": [
        {"variant": "gptq", "provider": "sdpa", "ok": True, "max_active_jobs": 5,
         "jobs": {"a": {"identical": True}, "b": {"identical": False, "parted_at_tie": True}},
         "provider_stats": {"largest_kvcache_batch": 5}, "shared_prefix_cached_tokens": 256},
        {"variant": "fp16", "provider": "sdpa", "ok": False, "error": "RuntimeError: no CUDA"},
    ]}))
    served = tmp_path / "check-gptq.json"
    served.write_text(json.dumps({
        "variant": "gptq", "engine": "exllamav2", "attention_provider": "sdpa", "paged": True,
        "checks": [{"check": "concurrent_streams", "ok": True}], "errors": [], "direct_provider": "sdpa",
        "grpc_tok_s": 98.0, "direct_tok_s": 100.0, "ratio": 0.98,
        "rates": {"grpc_tok_s": {"1": 98.0, "16": 900.0}, "direct_tok_s": {"1": 100.0, "16": 1000.0},
                  "ratio": {"1": 0.98, "16": 0.9}, "target": 0.97},
    }))
    reports = [report.read_variant(smoke), report.read_variant(served)]
    smokes, variants = report.split_reports(reports)
    text = "\n".join(report.variant_lines(variants, report.smoke_results(smokes)))
    assert "gptq     yes   sdpa" in text
    assert "paged smoke ok (sdpa): 1/2 jobs token-identical to unpaged (1 parted at a near tie), 5 at once" in text
    assert "1: 98.0 / 100.0 = 0.980; 16: 900.0 / 1000.0 = 0.900 BELOW" in text
    assert "fp16" in text and "paged smoke FAIL: RuntimeError: no CUDA" in text  # smoked, never served
    assert report.failed([], reports)  # a model that failed its smoke fails the run
    cut = tmp_path / "smoke-exl2.json"
    cut.write_text('{"kind": "paged_sm')
    assert report.read_variant(cut)["kind"] == "paged_smoke" and report.failed([], [report.read_variant(cut)])


PAGE = 256


def fake_exllamav2(paged_token_shift: int = 0) -> types.ModuleType:
    """Just enough of exllamav2 0.3.2 for paged_smoke.py and check.py's direct baseline to run on the CPU:
    its classes' keyword arguments checked against 0.3.2's, jobs started as the page table allows
    (all up to max_batch_size paged, one at a time unpaged), one greedy token per active job per
    iterate() with its logits, a whole prefix page reused from a job started before, and in paged
    mode every decode step's attention through tokenspout's provider, batched, with a block table."""
    import torch

    from backend.exllamav2 import paged_attention
    from tests.harness.exllamav2_fakes import GENERATOR_PARAMETERS, JOB_PARAMETERS

    vocab = 64

    class Config:
        def __init__(self, model_dir: str) -> None:
            self.model_dir, self.vocab_size, self.max_seq_len, self.max_input_len = model_dir, vocab, 2048, 2048
            self.max_attention_size, self.no_flash_attn, self.max_batch_size = 2048**2, False, 1

        def arch_compat_overrides(self) -> None:
            pass

    class Model:
        def __init__(self, config: Config) -> None:
            self.config, self.loaded = config, False

        def load_autosplit(self, cache) -> None:
            self.loaded = True

        def unload(self) -> None:
            self.loaded = False

    class Cache:
        def __init__(self, model: Model, max_seq_len: int = -1, lazy: bool = False) -> None:
            assert max_seq_len % PAGE == 0, max_seq_len
            self.max_seq_len = max_seq_len

    class Tokenizer:
        bos_token_id = 0

        def __init__(self, config: Config, lazy_init: bool = True) -> None:
            pass

        def encode(self, text: str, add_bos: bool = False):
            ids = [sum(map(ord, word)) % (vocab - 4) + 4 for word in text.split()]
            return torch.tensor([[0] * add_bos + ids])

    class Job:
        def __init__(self, **kwargs) -> None:
            assert set(kwargs) <= JOB_PARAMETERS, set(kwargs) - JOB_PARAMETERS
            self.ids = kwargs["input_ids"][0].tolist()
            self.max_new_tokens, self.identifier = kwargs["max_new_tokens"], kwargs.get("identifier")
            self.return_logits, self.generated, self.cached_tokens = kwargs.get("return_logits", False), 0, 0

    class Generator:
        def __init__(self, model: Model, cache: Cache, tokenizer: Tokenizer, **kwargs) -> None:
            assert set(kwargs) <= GENERATOR_PARAMETERS, set(kwargs) - GENERATOR_PARAMETERS
            self.paged = kwargs.get("paged", True)
            if self.paged:
                assert attn.has_flash_attn_with_paged and not model.config.no_flash_attn
                assert kwargs.get("max_chunk_size", PAGE) % PAGE == 0
            self.max_batch_size = kwargs.get("max_batch_size") or 16
            self.pending_jobs, self.active_jobs, self.started = [], [], []

        def enqueue(self, job: Job) -> None:
            self.pending_jobs.append(job)

        def num_remaining_jobs(self) -> int:
            return len(self.pending_jobs) + len(self.active_jobs)

        def iterate(self) -> list[dict]:
            batch = self.max_batch_size if self.paged else 1
            while self.pending_jobs and len(self.active_jobs) < batch:
                job = self.pending_jobs.pop(0)
                reused = any(len(job.ids) > PAGE and other.ids[:PAGE] == job.ids[:PAGE] for other in self.started)
                job.cached_tokens = PAGE if self.paged and reused else 0
                self.started.append(job)
                self.active_jobs.append(job)
            if self.paged and self.active_jobs:
                self.attend(len(self.active_jobs))
            results = []
            for job in list(self.active_jobs):
                token = (sum(job.ids) + 7 * job.generated + paged_token_shift * self.paged) % vocab
                job.generated += 1
                result = {"identifier": job.identifier, "stage": "streaming", "eos": False,
                          "token_ids": torch.tensor([[token]])}
                if job.return_logits:
                    logits = torch.zeros(1, 1, vocab + 32)
                    logits[0, 0, token] = 1.0
                    result["logits"] = logits
                if job.generated == job.max_new_tokens:
                    result.update(eos=True, cached_tokens=job.cached_tokens)
                    self.active_jobs.remove(job)
                results.append(result)
            time.sleep(0.001)
            return results

        @staticmethod
        def attend(batch: int) -> None:
            q = torch.randn(batch, 1, 2, 8)
            k_cache, v_cache = torch.zeros(2 * batch, PAGE, 1, 8), torch.zeros(2 * batch, PAGE, 1, 8)
            block_table = torch.arange(2 * batch, dtype=torch.int32).reshape(batch, 2)
            attn.flash_attn_with_kvcache(q, k_cache, v_cache, k=torch.randn(batch, 1, 1, 8), v=torch.randn(batch, 1, 1, 8),
                                         cache_seqlens=torch.full((batch,), 3, dtype=torch.int32),
                                         block_table=block_table, causal=True)

    class Sampler:
        class Settings:
            @staticmethod
            def greedy(**kwargs):
                return types.SimpleNamespace(top_k=1, **kwargs)

    attn = types.ModuleType("exllamav2.attn")
    attn.has_flash_attn_with_paged = True
    attn.flash_attn_with_kvcache = paged_attention.flash_attn_with_kvcache
    generator = types.ModuleType("exllamav2.generator")
    generator.ExLlamaV2DynamicGenerator, generator.ExLlamaV2DynamicJob, generator.ExLlamaV2Sampler = Generator, Job, Sampler
    exllamav2 = types.ModuleType("exllamav2")
    exllamav2.__version__ = "0.3.2-fake"
    exllamav2.ExLlamaV2Config, exllamav2.ExLlamaV2, exllamav2.ExLlamaV2Cache = Config, Model, Cache
    exllamav2.ExLlamaV2Tokenizer, exllamav2.attn, exllamav2.generator = Tokenizer, attn, generator
    return exllamav2


@pytest.fixture
def fake_exl(monkeypatch):
    """Installs fake_exllamav2(**options) as exllamav2 for the test (its provider needs torch: the dev extra's CPU build)."""
    pytest.importorskip("torch")

    def install(**options) -> types.ModuleType:
        module = fake_exllamav2(**options)
        for name, value in (("exllamav2", module), ("exllamav2.attn", module.attn), ("exllamav2.generator", module.generator)):
            monkeypatch.setitem(sys.modules, name, value)
        return module

    return install


def test_the_paged_smoke_runs_through_and_reports_on_a_fake_exllamav2(fake_exl, monkeypatch, tmp_path):
    from backend.exllamav2 import attention_provider

    smoke = load_module("paged_smoke")
    module = fake_exl()
    monkeypatch.setattr(attention_provider, "import_exllamav2", lambda setting: (module, setting))
    out = tmp_path / "smoke.json"
    assert smoke.main([str(tmp_path / "fp16"), str(tmp_path / "gptq"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["provider"] == "sdpa" and [m["variant"] for m in report["models"]] == ["fp16", "gptq"]
    result = report["models"][0]
    assert result["failures"] == [] and result["max_active_jobs"] == 5 and result["reference_max_active_jobs"] == 1
    assert result["provider_stats"]["largest_kvcache_batch"] == 5 and result["reference_provider_calls"] == 0
    assert result["shared_prefix_cached_tokens"] == PAGE
    assert all(job["identical"] for job in result["jobs"].values())
    parting = fake_exl(paged_token_shift=1)
    monkeypatch.setattr(attention_provider, "import_exllamav2", lambda setting: (parting, setting))
    assert smoke.main([str(tmp_path / "exl2"), "--json", str(out)]) == 1
    failures = json.loads(out.read_text())["models"][0]["failures"]
    assert len(failures) == 5 and all("parts from unpaged at token 0" in f for f in failures), failures


def test_the_direct_baseline_runs_through_on_a_fake_exllamav2(fake_exl, monkeypatch):
    from backend.exllamav2 import attention_provider

    module = fake_exl()
    monkeypatch.setattr(attention_provider, "import_exllamav2", lambda setting: (module, "sdpa"))
    measured = rates.direct_rates(pathlib.Path("/nonexistent"), "sdpa", [[0, 5, 6]] * 16, tokens=24, reps=1)
    assert measured["provider"] == "sdpa" and measured["paged"] and set(measured["tok_s"]) == {"1", "4", "16"}
    assert measured["tok_s"]["16"] > 2 * measured["tok_s"]["1"] > 0  # sixteen decode in the time of one


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
    assert table["provider"] == ["SKIP", "0", "needs extension (SKIP)"]
    assert table["model_check"] == ["SKIP", "0", "needs tiny_model (SKIP)"]
    assert all(table[s] == ["SKIP", "0", "no GPU (nvidia-smi -L fails)"] for s in GPU_STAGES)
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


def test_run_sh_skips_a_stage_left_under_half_its_limit(tmp_path):
    """Started that short it would fail for want of time and say something else (a server given 10 s
    "did not start"): skipped, it says why. 36 s: the preflight gets 21 of its 30, the wheels at most 21 of 45."""
    rc, output, table = run_gpu_check(tmp_path, GPU_CHECK_BUDGET_S="36")
    assert rc == 1, output
    assert table["preflight"][0] != "SKIP", table
    assert table["wheels"][0] == "SKIP" and table["wheels"][2].startswith("no time left"), table
    assert "of the 45s it may need" in table["wheels"][2]


@pytest.mark.skipif(os.environ.get("TOKENSPOUT_GPU_REHEARSAL") != "1", reason="set TOKENSPOUT_GPU_REHEARSAL=1 (9-16 min)")
def test_the_cpu_rehearsal_passes():
    rehearse = ROOT / "bench" / "gpu" / "rehearse.sh"
    done = subprocess.run(["bash", str(rehearse)], capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "rehearsal: 0 failed" in done.stdout


def test_the_real_size_summary_sets_each_rate_against_the_bandwidth_limit():
    report = load_module("real_report")
    bandwidth = {"kind": "real_size", "layer": "bandwidth", "bandwidth": {"gb_s": 3000.0, "device": "H100"}, "errors": []}
    direct = {"kind": "real_size", "layer": "direct", "format": "exl2", "weight_bytes_per_token": 3e9, "load_s": 9.0,
              "load_check": {"finite": True}, "raw_forward": {"tok_s": 200.0}, "errors": [],
              "direct_tok_s": {"triton": {"1": 150.0, "64": 3000.0}, "sdpa": {"1": 140.0, "64": 1500.0}}}
    served = {"kind": "real_size", "layer": "grpc", "format": "exl2", "attention": "triton", "errors": ["x: boom"],
              "grpc_tok_s": {"1": 147.0, "64": 2800.0}}
    text = "\n".join(report.lines([bandwidth, served, direct]))
    assert "copy bandwidth 3000.0 GB/s on H100" in text
    assert "limit 1000.0 tok/s at one stream" in text and "own forward 200.0 tok/s (0.20 of limit) BELOW 0.25" in text
    assert "1 streams: gRPC 147.0 (0.15 of limit); direct triton 150.0 (0.15 of limit)" in text
    assert "gRPC/direct 0.980; triton/sdpa 1.07x" in text
    assert "64 streams: gRPC 2800.0 (0.04 of limit)" in text and "gRPC/direct 0.933 BELOW; triton/sdpa 2.00x" in text
    assert "error (exl2 grpc): x: boom" in text


@pytest.mark.timeout(900)
def test_the_real_size_device_run_rehearsed_on_the_cpu_with_stand_ins(tmp_path):
    """The whole real-size plan (run.sh GPU_CHECK_PLAN=real-size) with the tiny shape, the stand-in
    exllamav2 and the scripted engine: every stage passes, and a failed stage leaves the rest running.
    Its scratch folder is the test's own (the script's default is one fixed /tmp path for every checkout)."""
    pytest.importorskip("triton")
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "rehearse.sh"), "--real-size"],
                          capture_output=True, text=True, timeout=880,
                          env={**os.environ, "PYTHON": sys.executable, "SCRATCH": str(tmp_path / "scratch")})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "PASS clean" in done.stdout and "PASS fail-direct_exl2" in done.stdout
    assert "real-size rehearsal: 0 failed" in done.stdout
