"""The exllamav2 engine end to end: serve a model directory through tokenspout and prove the contract.

bench/gpu/run.sh runs it on a CUDA machine for each variant of the tiny model (FP16, GPTQ,
EXL2). Each check prints one line; the figures and results go to --json, rewritten after
every step, so a run cut off at its limit still leaves what it found. The last figures are
decode tokens/s through gRPC at 1, 4 and 16 concurrent streams, each divided by exllamav2 driven
directly (a child process, the engine's generator settings and attention provider) on the same
prompts: what the service costs (target: a ratio of at least 0.97).
The checks are bench/gpu/checks.py's, the rates bench/gpu/rates.py's; this script serves, runs them
in turn within the time left, and writes the report.

The server runs with its default attention (`auto`: flash-attn if a paged one imports, else
tokenspout's SDPA paged attention), reported by GetModelInfo's attention_provider ("unknown" where
the field is missing). When that is paged, the concurrent-streams check also proves the streams
were batched: the engine ran at least two at once (GetServerStatus) in fewer steps than their tokens.
transformers (--reference-hf) runs in this process, which never imports exllamav2, so it never
sees the stand-in flash_attn the provider lends exllamav2.

    python bench/gpu/check.py --model DIR --name fp16 --json OUT.json [--reference-hf] [--time-limit S]
    python bench/gpu/check.py --engine exllamav3 --model DIR --name exl3 --json OUT.json   # the EXL3 variant
    python bench/gpu/check.py --address HOST:PORT   # an already running server, any engine
    python bench/gpu/check.py --direct --model DIR --attention sdpa --prompts IDS.json --json OUT.json

With --engine exllamav3 (bench/gpu/stages_exl3.sh) the server runs the exllamav3 engine, the checks expect
its samplers and weights, and the direct baseline is exllamav3 driven directly (bench/gpu/rates_exl3.py).

Every wait is bounded: the server gets at most 180 s to start (less if --time-limit says so),
every RPC has a deadline, the checks still to run when time is short are reported as not run,
and a server that will not stop is killed. A failure in one step (a check, the transformers
reference, a rate) is recorded with the others, never instead of them.

With --address the checks run against whatever is serving there and the direct
baseline is skipped: that is how the checks themselves are tried on a machine
without a GPU, against the llama.cpp engine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # run as a file on the GPU machine, beside no installed tokenspout

import grpc  # noqa: E402

from bench.gpu.checks import PAGED_PROVIDERS, Checks, attention_provider, runs_paged  # noqa: E402
from bench.gpu.model_check import PROMPT, SAFE_MARGIN, STEPS, greedy_with_margins  # noqa: E402
from bench.gpu.rates import (  # noqa: E402
    BATCH,
    CONTEXT,
    RATIO_TARGET,
    RPC_TIMEOUT_S,
    direct_rates,
    grpc_rates,
    rate_prompts,
    rate_table,
)
from bench.harness.streams import greedy_request, timed_request  # noqa: E402
from tests.harness.helpers import stream, text_of  # noqa: E402
from tests.harness.servers import start_server  # noqa: E402
from tokenspout.v1 import generation_pb2 as pb  # noqa: E402
from tokenspout.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

SERVER_START_S = 180
GRPC_RATES_S = 20  # the gRPC rates are not started with less left (they take ~10 s on the H200)
DIRECT_RATES_S = 25  # nor the direct baseline (a child: torch and exllamav2 imports, the load, ~15 s)


def direct_setting(provider: str, paged: bool) -> str:
    """The exllamav2.attention setting that gives the direct baseline the server's provider."""
    return {"sdpa": "sdpa", "flash-attn": "flash-attn", "none": "off"}.get(provider, "auto" if paged else "off")


def direct_in_child(model_dir: pathlib.Path, setting: str, prompt_ids: list[list[int]], timeout_s: float,
                    engine: str = "exllamav2") -> dict:
    """direct_rates in a child process: exllamav2 (and the stand-in flash_attn its provider lends it
    during the import) never enter this one, where transformers runs; its GPU memory goes with it."""
    with tempfile.TemporaryDirectory(prefix="tokenspout-direct-") as scratch:
        prompts, out = pathlib.Path(scratch) / "prompts.json", pathlib.Path(scratch) / "direct.json"
        prompts.write_text(json.dumps(prompt_ids))
        command = [sys.executable, __file__, "--direct", "--model", str(model_dir), "--attention", setting,
                   "--prompts", str(prompts), "--json", str(out), "--engine", engine]
        done = subprocess.run(command, timeout=timeout_s)
        if done.returncode or not out.exists():
            raise RuntimeError(f"the direct baseline exited {done.returncode} (its output is above)")
        return json.loads(out.read_text())


def hf_reference(model_dir: pathlib.Path, stub) -> dict:
    """Greedy tokens from transformers on the FP16 weights against the same through tokenspout.

    Both encode the prompt alike (the check compares the ids). The tokens must agree on every step,
    or part only where transformers' own top two logits are a near tie (under SAFE_MARGIN): there
    FP16 rounding on either side legitimately picks the other token, and the rest diverges.
    """
    # transformers looks for flash_attn by its spec: this process must never have imported exllamav2
    # through the provider that lends it a stand-in (the direct baseline runs in a child for that).
    assert not {"exllamav2", "flash_attn"} & set(sys.modules), "exllamav2 or a flash_attn is in this process"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=RPC_TIMEOUT_S).token_ids)
    same_prompt = tokenizer(PROMPT)["input_ids"] == ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).cuda()
    try:
        reference, margins = greedy_with_margins(model, ids, STEPS)
    finally:
        del model
        torch.cuda.empty_cache()
    request = greedy_request(PROMPT, STEPS)
    request.output.return_token_ids = True
    ours = [t.id for m in stream(stub, request) for t in m.tokens]
    ok, detail = compare_greedy(ours, reference, margins)
    ok = ok and same_prompt
    detail += f", prompt ids {'equal' if same_prompt else 'DIFFER'}"
    print(f"  {'PASS' if ok else 'FAIL'} hf_reference: {detail}", flush=True)
    return {"check": "hf_reference", "ok": ok, "skipped": False, "detail": detail}


def compare_greedy(ours: list[int], reference: list[int], margins: list[float]) -> tuple[bool, str]:
    """All STEPS tokens equal, or parted only where the reference's top two were a near tie."""
    agree = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    parted_at_tie = agree < len(margins) and margins[agree] < SAFE_MARGIN
    ok = len(ours) == len(reference) == STEPS and (agree == STEPS or parted_at_tie)
    detail = f"{agree}/{STEPS} greedy tokens agree, smallest transformers margin {min(margins, default=0):.3f}"
    if agree < len(margins):
        detail += f"; they part at step {agree}, where transformers' top two are {margins[agree]:.3f} apart"
    return ok, detail


def stop_or_kill(server, grace_s: float = 20) -> int:
    """The server's exit code; one that does not stop within grace_s of SIGTERM is killed."""
    if server.process.poll() is None:
        server.process.terminate()
    try:
        return server.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(f"  the server did not stop within {grace_s:.0f} s of SIGTERM: killed", flush=True)
        server.process.kill()
        return server.process.wait(timeout=10)


class Report:
    """One variant's results, written to disk after every step, with each step's failure kept apart."""

    def __init__(self, variant: str, path: str | None) -> None:
        self.data: dict = {"variant": variant, "checks": [], "errors": []}
        self.path = pathlib.Path(path) if path else None

    def save(self) -> None:
        if self.path:
            partial = self.path.with_suffix(".json.tmp")
            partial.write_text(json.dumps(self.data, indent=2))
            partial.replace(self.path)

    def add_check(self, result: dict) -> None:
        self.data["checks"].append(result)
        self.save()

    def step(self, name: str, function, *args, **kwargs):
        """function(*args, **kwargs), or None with the error recorded; the report is saved either way."""
        try:
            return function(*args, **kwargs)
        except Exception as exc:  # one step's failure is a finding; the others still run
            traceback.print_exc()
            self.data["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:400])
            return None
        finally:
            self.save()


def serve_and_check(args, report: Report) -> None:
    deadline = time.monotonic() + args.time_limit

    def seconds_left() -> float:
        return deadline - time.monotonic()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tokenspout-gpu-"))
    flags = ("--engine", args.engine, "--model", str(args.model), "--context-length", str(CONTEXT),
             "--max-batch-size", str(BATCH), "--model-id", args.name)
    started = time.perf_counter()
    start_limit = max(10.0, min(SERVER_START_S, seconds_left() - 60))
    server = report.step("server start", start_server, tmp, *flags, timeout_s=start_limit)
    if server is None:
        report.add_check({"check": "serve", "ok": False, "skipped": False, "detail": report.data["errors"][-1]})
        return
    report.data["load_s"] = round(time.perf_counter() - started, 1)
    rates, prompt_ids, provider, paged = None, None, "unknown", False
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            checks = report.step("model info", Checks, stub, True, args.engine)
            if checks is not None:
                provider, paged = checks.provider, checks.paged
                report.data.update(engine=checks.info.engine, attention_provider=provider, paged=paged,
                                   max_batch_size=checks.info.limits.max_batch_size)
                checks.run_all(seconds_left, report.add_check)
            if args.reference_hf:
                result = report.step("hf_reference", hf_reference, args.model, stub)
                report.add_check(result or {"check": "hf_reference", "ok": False, "skipped": False,
                                            "detail": report.data["errors"][-1]})
            if seconds_left() > GRPC_RATES_S:
                prompt_ids = report.step("rate prompts", tokenized, stub, rate_prompts())
                rates = report.step("gRPC rates", grpc_rates, stub)
    finally:
        report.data["server_exit"] = report.step("server stop", stop_or_kill, server)
        if report.path:
            report.path.with_suffix(".log").write_text(server.log())
    direct = None
    if rates and prompt_ids and seconds_left() > DIRECT_RATES_S:
        setting = direct_setting(provider, paged)
        direct = report.step("direct rates", direct_in_child, args.model, setting, prompt_ids, seconds_left() - 3,
                             args.engine)
        if direct and provider in PAGED_PROVIDERS + ("none",) and direct["provider"] != provider:
            report.data["errors"].append(f"direct rates: {args.engine} ran on {direct['provider']}, the server on {provider}")
    record_rates(report, rates, direct, args.engine)


def tokenized(stub, prompts: list[str]) -> list[list[int]]:
    """The ids the server feeds the engine for these text prompts, for the direct baseline to feed it too."""
    return [list(stub.Tokenize(pb.TokenizeRequest(text=p), timeout=RPC_TIMEOUT_S).token_ids) for p in prompts]


def record_rates(report: Report, through_grpc: dict | None, direct: dict | None, engine: str = "exllamav2") -> None:
    """The rates in the report: the table per stream count, and the one-stream figures under their old names."""
    if through_grpc:
        report.data["engine_steps"] = through_grpc["engine_steps"]
    if direct:
        report.data["direct_provider"] = direct["provider"]
    if through_grpc:
        table = rate_table(through_grpc["tok_s"], (direct or {}).get("tok_s", {}))
        report.data["rates"] = table
        report.data["grpc_tok_s"] = table["grpc_tok_s"].get("1")
        report.data["direct_tok_s"] = table["direct_tok_s"].get("1")
        report.data["ratio"] = table["ratio"].get("1")
        for n, ratio in table["ratio"].items():
            print(f"  decode at {n} streams: gRPC {table['grpc_tok_s'][n]:.1f} tok/s, {engine} directly "
                  f"{table['direct_tok_s'][n]:.1f} tok/s, ratio {ratio:.3f} (target {RATIO_TARGET})", flush=True)
    report.save()


def speculation_rates(args, report: Report) -> None:
    """exllamav2's own n-gram drafting against none, one server each in turn: the same greedy tokens,
    draft tokens counted in Usage, and decode tokens/s at 1 and 4 concurrent streams (copying text,
    where drafting pays most)."""
    deadline = time.monotonic() + args.time_limit
    copy = ("Repeat after me, exactly: " + PROMPT) * 2
    outputs, rates = {}, {}
    for setting in ("off", "ngram"):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"tokenspout-gpu-{setting}-"))
        flags = ("--engine", args.engine, "--model", str(args.model), "--context-length", str(CONTEXT),
                 "--max-batch-size", str(BATCH), "--speculation", setting, "--max-draft-tokens", "4")
        server = report.step(f"server start ({setting})", start_server, tmp, *flags,
                             timeout_s=max(10.0, min(SERVER_START_S, deadline - time.monotonic() - 30)))
        if server is None:
            report.add_check({"check": f"speculation {setting}", "ok": False, "skipped": False,
                              "detail": report.data["errors"][-1]})
            return
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
                provider = attention_provider(info)
                report.data.update(engine=info.engine, attention_provider=provider, paged=runs_paged(info, provider))
                _, rate, last = timed_request(stub, greedy_request(copy, 128))
                outputs[setting] = (text_of(stream(stub, greedy_request(copy, 128))), last.finish.usage)
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    start = time.perf_counter()
                    list(pool.map(
                        lambda _, stub=stub: list(stub.GenerateStream(greedy_request(copy, 128), timeout=300)), range(4)))
                    rates[setting] = (rate, 4 * 128 / (time.perf_counter() - start))
        finally:
            stop_or_kill(server)
    same = outputs["off"][0] == outputs["ngram"][0]
    usage = outputs["ngram"][1]
    report.data["speculation"] = {
        "tok_s_off": rates["off"], "tok_s_ngram": rates["ngram"],
        "ratio_1": rates["ngram"][0] / rates["off"][0], "ratio_4": rates["ngram"][1] / rates["off"][1],
        "draft_tokens": usage.draft_tokens, "accepted_draft_tokens": usage.accepted_draft_tokens,
    }
    detail = (f"ngram/off decode {report.data['speculation']['ratio_1']:.2f}x at 1 stream, "
              f"{report.data['speculation']['ratio_4']:.2f}x at 4; drafts {usage.accepted_draft_tokens}/"
              f"{usage.draft_tokens} accepted; greedy output {'the same' if same else 'DIFFERENT'}")
    report.add_check({"check": "speculation", "ok": same and usage.draft_tokens > 0, "skipped": False,
                      "detail": detail})
    print(f"  {detail}", flush=True)
    report.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, help="an EXL2, GPTQ, EXL3, FP16 or BF16 model directory")
    parser.add_argument("--engine", choices=("exllamav2", "exllamav3"), default="exllamav2",
                        help="the engine served and driven directly")
    parser.add_argument("--name", default="model")
    parser.add_argument("--json", help="where to write this variant's report")
    parser.add_argument("--reference-hf", action="store_true", help="also compare greedy tokens with transformers")
    parser.add_argument("--time-limit", type=float, default=600, help="seconds for all of it, the server start too")
    parser.add_argument("--address", help="check a running server instead (no direct baseline)")
    parser.add_argument("--speculation", action="store_true",
                        help="only compare exllamav2's n-gram drafting with none (two servers in turn)")
    parser.add_argument("--direct", action="store_true",
                        help="only the direct baseline's rates (what serving runs in a child), to --json")
    parser.add_argument("--attention", default="auto", help="--direct: the exllamav2.attention setting")
    parser.add_argument("--prompts", type=pathlib.Path, help="--direct: a JSON list of prompts' token ids")
    args = parser.parse_args()
    if args.address:
        with grpc.insecure_channel(args.address) as channel:
            results = Checks(pb_grpc.GenerationServiceStub(channel), expect_exllamav2=False).run_all()
        return 0 if all(r["ok"] for r in results) else 1
    if args.direct and args.engine == "exllamav3":
        from bench.gpu.rates_exl3 import direct_rates as exllamav3_rates

        rates = exllamav3_rates(args.model, json.loads(args.prompts.read_text()))
        pathlib.Path(args.json).write_text(json.dumps(rates, indent=2))
        return 0
    if args.direct:
        rates = direct_rates(args.model, args.attention, json.loads(args.prompts.read_text()))
        pathlib.Path(args.json).write_text(json.dumps(rates, indent=2))
        return 0
    report = Report(args.name, args.json)
    report.step("serve and check", speculation_rates if args.speculation else serve_and_check, args, report)
    data = report.data
    return 0 if data["checks"] and all(c["ok"] for c in data["checks"]) and not data["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
