"""The exllamav2 engine end to end: serve a model directory through tokenspout and prove the contract.

bench/gpu/run.sh runs it on a CUDA machine for each variant of the tiny model (EXL2, GPTQ,
FP16). Each check prints one line; the figures and results go to --json. The last figure
is decode tokens/s through gRPC divided by exllamav2 driven directly in the same run.

    python bench/gpu/check.py --model DIR --name exl2 --json OUT.json [--reference-hf]
    python bench/gpu/check.py --address HOST:PORT   # an already running server, any engine
    python bench/gpu/check.py --summarize OUT1.json OUT2.json ...

With --address the checks run against whatever is serving there and the direct
baseline is skipped: that is how the checks themselves are tried on a machine
without a GPU, against the llama.cpp engine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import grpc  # noqa: E402
import jsonschema  # noqa: E402

from backend.exllamav2.settings import SUPPORTED_SAMPLERS  # noqa: E402
from common import greedy_request, timed_stream  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402
from helpers import stream, text_of  # noqa: E402
from tokenspout.v1 import generation_pb2 as pb  # noqa: E402
from tokenspout.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PROMPT = "The history of the printing press"
CONTEXT, BATCH, RATE_TOKENS = 2048, 8, 256
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# One request per sampler beyond the basics, each set to act.
SAMPLER_SETTINGS = {
    "dry": {"dry": pb.DrySampler(multiplier=0.8)},
    "xtc": {"xtc": pb.XtcSampler(probability=0.5, threshold=0.1)},
    "mirostat": {"mirostat": pb.MirostatSampler(tau=3.0)},
    "top_a": {"top_a": 0.2},
    "tfs": {"tfs": 0.9},
    "skew": {"skew": 1.0},
    "smoothing_factor": {"smoothing_factor": 0.5},
    "banned_strings": {"banned_strings": ["the"]},
    "token_healing": {"token_healing": True},
    "min_p": {"min_p": 0.05},
    "typical_p": {"typical_p": 0.9},
}


class Skipped(Exception):
    """A check that does not apply to the engine being checked."""


class Checks:
    NAMES = (
        "model_info", "streams_incrementally", "logprobs_and_alternatives", "every_eos_id_ends_a_stream",
        "stop_sequence_is_held_back", "chat", "cancel_mid_stream", "json_schema_stream", "samplers_run",
        "over_budget_is_out_of_range", "concurrent_streams",
    )

    def __init__(self, stub: pb_grpc.GenerationServiceStub, expect_exllamav2: bool) -> None:
        self.stub = stub
        self.info = stub.GetModelInfo(pb.GetModelInfoRequest())
        self.expect_exllamav2 = expect_exllamav2

    def model_info(self) -> str:
        samplers = set(self.info.samplers)
        if self.expect_exllamav2:
            assert self.info.engine.startswith("exllamav2"), self.info.engine
            assert set(SUPPORTED_SAMPLERS) <= samplers, set(SUPPORTED_SAMPLERS) - samplers
            assert self.info.quantization.split()[0] in ("EXL2", "GPTQ", "FP16"), self.info.quantization
        info = self.info
        return f"engine {info.engine!r}, {info.quantization}, batch {info.limits.max_batch_size}, {len(samplers)} samplers"

    def streams_incrementally(self) -> str:
        request = greedy_request(PROMPT, 64)
        request.output.return_token_ids = True
        messages = stream(self.stub, request)
        unary = self.stub.Generate(pb.GenerateRequest.FromString(request.SerializeToString()), timeout=120)
        assert len(messages) > 1 and messages[-1].generated_tokens == 64, (len(messages), messages[-1].generated_tokens)
        assert messages[-1].finish.reason == pb.FINISH_REASON_MAX_TOKENS
        assert text_of(messages) == unary.text, "streamed deltas differ from the unary result"
        tokens = [t.id for m in messages for t in m.tokens]
        assert len(tokens) == 64
        return f"{len(messages)} messages, {len(tokens)} tokens, equal to the unary result"

    def logprobs_and_alternatives(self) -> str:
        request = greedy_request(PROMPT, 8)
        request.output.return_logprobs, request.output.top_logprobs = True, 3
        tokens = [t for m in stream(self.stub, request) for t in m.tokens]
        assert len(tokens) == 8
        for token in tokens:
            assert token.logprob <= 0 and len(token.top_logprobs) == 3, token
            assert token.top_logprobs[0].id == token.id, "greedy picks the likeliest"
        return f"8 tokens, each with its logprob and 3 alternatives (first: {tokens[0].logprob:.3f})"

    def every_eos_id_ends_a_stream(self) -> str:
        for eos in self.info.special_tokens.eos_token_ids:
            request = pb.GenerateStreamRequest(
                prompt=PROMPT, sampling=pb.SamplingParams(temperature=0.0), stopping=pb.StoppingCriteria(max_new_tokens=8)
            )
            request.sampling.logit_bias[eos] = 100.0
            finish = stream(self.stub, request)[-1].finish
            assert finish.reason == pb.FINISH_REASON_EOS_TOKEN, (eos, finish)
        return f"end ids {list(self.info.special_tokens.eos_token_ids)}"

    def stop_sequence_is_held_back(self) -> str:
        free = text_of(stream(self.stub, greedy_request(PROMPT, 32)))
        stop = free[len(free) // 2 : len(free) // 2 + 4]
        request = greedy_request(PROMPT, 32)
        request.stopping.stop_sequences.append(stop)
        messages = stream(self.stub, request)
        assert messages[-1].finish.reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert text_of(messages) == free[: free.index(stop)], (text_of(messages), free, stop)
        return f"stopped at {stop!r}, nothing of it streamed"

    def chat(self) -> str:
        if not self.info.has_chat_template:
            raise Skipped("the model has no chat template")
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hello there")])
        prompt = self.stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids
        messages = stream(self.stub, pb.GenerateStreamRequest(chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=8)))
        assert messages[0].input_tokens == len(prompt) and messages[-1].HasField("finish")
        return f"{len(prompt)} prompt tokens from the template"

    def cancel_mid_stream(self) -> str:
        call = self.stub.GenerateStream(greedy_request(PROMPT, CONTEXT // 2), timeout=120)
        for _, _message in zip(range(3), call):
            pass
        start = time.perf_counter()
        call.cancel()
        while self.stub.GetServerStatus(pb.GetServerStatusRequest()).running_sequences:
            assert time.perf_counter() - start < 5, "the cancelled job still runs after 5 s"
            time.sleep(0.002)
        freed_ms = (time.perf_counter() - start) * 1000
        after = stream(self.stub, greedy_request(PROMPT, 4))
        assert after[-1].generated_tokens == 4, "the server stopped serving after a cancel"
        return f"job gone {freed_ms:.1f} ms after the caller cancelled; serving on"

    def json_schema_stream(self) -> str:
        request = pb.GenerateStreamRequest(
            prompt=PROMPT,
            sampling=pb.SamplingParams(temperature=1.0, seed=3),
            stopping=pb.StoppingCriteria(max_new_tokens=256),
            constraint=pb.Constraint(json_schema=json.dumps(SCHEMA)),
        )
        messages = stream(self.stub, request)
        finish = messages[-1].finish
        assert finish.reason == pb.FINISH_REASON_CONSTRAINT_COMPLETE, pb.FinishReason.Name(finish.reason)
        value = json.loads(text_of(messages))
        jsonschema.validate(value, SCHEMA)
        return f"{len(messages)} messages, valid: {text_of(messages)[:60]!r}"

    def samplers_run(self) -> str:
        ran = []
        for name, settings in SAMPLER_SETTINGS.items():
            if name not in self.info.samplers:
                continue
            request = pb.GenerateStreamRequest(
                prompt=PROMPT,
                sampling=pb.SamplingParams(temperature=1.0, seed=1, **settings),
                stopping=pb.StoppingCriteria(max_new_tokens=16),
            )
            assert stream(self.stub, request)[-1].HasField("finish"), name
            ran.append(name)
        forced = greedy_request(PROMPT, 4)
        forced.output.return_token_ids = True
        forced.sampling.logit_bias[100] = 100.0
        assert [t.id for m in stream(self.stub, forced) for t in m.tokens] == [100] * 4, "logit_bias did not force"
        return "ran " + ", ".join(ran) + "; logit_bias forces"

    def over_budget_is_out_of_range(self) -> str:
        if not self.expect_exllamav2:
            raise Skipped("llama.cpp takes such a request and ends it with FINISH_REASON_CONTEXT_LIMIT")
        request = greedy_request(PROMPT, self.info.context_length)
        try:
            stream(self.stub, request)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.OUT_OF_RANGE, error.code()
            return error.details()[:80]
        raise AssertionError("a request over the context was accepted")

    def concurrent_streams(self) -> str:
        prompts = [f"{PROMPT} {i}" for i in range(4)]
        solo = [text_of(stream(self.stub, greedy_request(p, 48))) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: stream(self.stub, greedy_request(p, 48)), prompts))
        assert all(m[-1].generated_tokens == 48 for m in together)
        same = sum(text_of(m) == s for m, s in zip(together, solo))
        return f"4 at once all complete; {same}/4 identical to their solo runs"

    def run_all(self) -> list[dict]:
        results = []
        for name in self.NAMES:
            skipped = False
            try:
                detail, ok = getattr(self, name)(), True
            except Skipped as reason:
                detail, ok, skipped = str(reason), True, True
            except Exception as exc:  # a failed check is reported, and the others still run
                detail, ok = f"{type(exc).__name__}: {exc}"[:400], False
                traceback.print_exc()
            print(f"  {'SKIP' if skipped else 'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
            results.append({"check": name, "ok": ok, "skipped": skipped, "detail": detail})
        return results


def grpc_rate(stub, reps: int = 3) -> float:
    timed_stream(stub, PROMPT, 8)  # warm-up
    return statistics.median(timed_stream(stub, PROMPT, RATE_TOKENS)[1] for _ in range(reps))


def direct_rate(model_dir: pathlib.Path, reps: int = 3) -> float:
    """Decode tokens/s of the same greedy job, exllamav2 driven directly with the engine's settings."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.attn import has_flash_attn_with_paged
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    config = ExLlamaV2Config(str(model_dir))
    config.arch_compat_overrides()
    config.max_seq_len = CONTEXT
    paged = has_flash_attn_with_paged
    batch = BATCH if paged else 1
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=CONTEXT * batch, lazy=True)
    model.load_autosplit(cache)
    tokenizer = ExLlamaV2Tokenizer(config)
    generator = ExLlamaV2DynamicGenerator(
        model=model, cache=cache, tokenizer=tokenizer, max_batch_size=batch, max_seq_len=CONTEXT, paged=paged
    )
    input_ids = tokenizer.encode(PROMPT, add_bos=True)

    def one(tokens: int) -> float:
        job = ExLlamaV2DynamicJob(
            input_ids=input_ids, max_new_tokens=tokens, stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(), identifier="direct",
        )
        generator.enqueue(job)
        first = last = None
        count = 0
        while generator.num_remaining_jobs():
            for result in generator.iterate():
                if result.get("token_ids") is not None:  # one result may carry several held-back tokens
                    last = time.perf_counter()
                    first = first or last
                    count += result["token_ids"].shape[-1]
        assert count == tokens, count
        # The same measure as timed_request: tokens after the first arrival, over the time they took.
        return (tokens - 1) / (last - first)

    one(8)
    rate = statistics.median(one(RATE_TOKENS) for _ in range(reps))
    model.unload()  # frees the weights; the cache goes with this frame
    return rate


def hf_reference(model_dir: pathlib.Path, stub) -> dict:
    """Greedy tokens from transformers on the FP16 weights against the same through tokenspout."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).cuda()
    model.generation_config.eos_token_id = None  # run on past end ids, as ignore_eos does
    ids = stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids
    output = model.generate(torch.tensor([list(ids)]).cuda(), max_new_tokens=16, do_sample=False)
    reference = output[0, len(ids) :].tolist()
    request = greedy_request(PROMPT, 16)
    request.output.return_token_ids = True
    ours = [t.id for m in stream(stub, request) for t in m.tokens]
    agree = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(reference))
    del model
    torch.cuda.empty_cache()
    ok = agree >= 8 and tokenizer(PROMPT)["input_ids"] == list(ids)
    print(f"  {'PASS' if ok else 'FAIL'} hf_reference: first {agree} of 16 greedy tokens agree with transformers")
    return {"check": "hf_reference", "ok": ok, "detail": f"{agree}/16 agree"}


def serve_and_check(args) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tokenspout-gpu-"))
    flags = ("--engine", "exllamav2", "--model", str(args.model), "--context-length", str(CONTEXT),
             "--max-batch-size", str(BATCH), "--model-id", args.name)
    started = time.perf_counter()
    server = start_server(tmp, *flags, timeout_s=600)
    load_s = time.perf_counter() - started
    report: dict = {"variant": args.name, "load_s": round(load_s, 1)}
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            checks = Checks(stub, expect_exllamav2=True)
            report["engine"] = checks.info.engine
            report["checks"] = checks.run_all()
            if args.reference_hf:
                report["checks"].append(hf_reference(args.model, stub))
            report["grpc_tok_s"] = grpc_rate(stub)
    finally:
        report["server_exit"] = stop_server(server)
        if args.json:
            pathlib.Path(args.json).with_suffix(".log").write_text(server.log())
    report["direct_tok_s"] = direct_rate(args.model)
    report["ratio"] = report["grpc_tok_s"] / report["direct_tok_s"]
    print(
        f"  decode through gRPC {report['grpc_tok_s']:.1f} tok/s, exllamav2 directly {report['direct_tok_s']:.1f} tok/s,"
        f" ratio {report['ratio']:.3f}"
    )
    return report


def summarize(paths: list[str]) -> int:
    failed = 0
    print("variant  engine                                   checks  gRPC tok/s  direct tok/s  ratio")
    for path in paths:
        report = json.loads(pathlib.Path(path).read_text())
        passed = sum(c["ok"] for c in report["checks"])
        failed += len(report["checks"]) - passed
        rates = (report.get("grpc_tok_s", 0.0), report.get("direct_tok_s", 0.0), report.get("ratio", 0.0))
        print(
            f"{report['variant']:<8} {report.get('engine', '-'):<40} {passed}/{len(report['checks']):<5}"
            f" {rates[0]:>10.1f} {rates[1]:>13.1f}  {rates[2]:.3f}"
        )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, help="an EXL2, GPTQ or FP16 model directory")
    parser.add_argument("--name", default="model")
    parser.add_argument("--json", help="where to write this variant's report")
    parser.add_argument("--reference-hf", action="store_true", help="also compare greedy tokens with transformers")
    parser.add_argument("--address", help="check a running server instead (no direct baseline)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON")
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if args.address:
        with grpc.insecure_channel(args.address) as channel:
            results = Checks(pb_grpc.GenerationServiceStub(channel), expect_exllamav2=False).run_all()
        return 0 if all(r["ok"] for r in results) else 1
    try:
        report = serve_and_check(args)
    except Exception as exc:  # still leave a report, so the summary names what broke
        traceback.print_exc()
        report = {"variant": args.name, "checks": [{"check": "serve", "ok": False, "detail": f"{type(exc).__name__}: {exc}"}]}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
