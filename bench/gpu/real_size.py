"""An 8B-shaped model's decode rate, measured in layers, each against the memory-bandwidth limit.

bench/gpu/run.sh (GPU_CHECK_PLAN=real-size) runs one command per layer, per format (EXL2, GPTQ,
FP16, models from make_random_model.py); each writes its JSON after every step, so a stage cut at its
limit keeps what it measured, and bench/gpu/report.py sets them side by side:

    python bench/gpu/real_size.py bandwidth --json OUT.json
        a copy-bandwidth probe: y.copy_(x) over --probe-mib, bytes read plus written per second
    python bench/gpu/real_size.py direct MODEL --format exl2 --json OUT.json [--providers triton,sdpa]
        one process, the model loaded once: a forward that must give finite logits (the loading check
        of the random model); exllamav2's own unpaged forward at one stream (its own attention, no
        provider: what the kernels do with nothing of ours); then its dynamic generator driven
        directly, as the engine builds it, at each --streams count, on each provider in turn (the new
        Triton kernel and the old SDPA provider, swapped in exllamav2.attn between runs)
    python bench/gpu/real_size.py grpc MODEL --format exl2 --json OUT.json
        `tokenspout serve` on the model (--attention, --max-batch-size, --cache-tokens as given), the
        same greedy streams through gRPC

Warm-up: --warmup-steps single-stream steps first (EXL2 times its first 200 GEMMs per small batch
to pick kernels, q_gemm_autotune.cuh), then 16 tokens at the most streams.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.gpu.make_random_model import SHAPES, layout  # noqa: E402
from bench.gpu.rates import rate_prompts  # noqa: E402

PROVIDERS = {"triton": "backend.exllamav2.paged_attention_triton", "sdpa": "backend.exllamav2.paged_attention"}


class Report:
    """One command's results, the whole JSON rewritten after every step; a failed step is recorded
    with the others and the next one still runs."""

    def __init__(self, path: pathlib.Path, **fields: object) -> None:
        self.path, self.data = path, {"kind": "real_size", **fields, "steps": [], "errors": []}
        self.save()

    def save(self) -> None:
        partial = self.path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(self.data, indent=2))
        partial.replace(self.path)

    def step(self, name: str, function, *args, **kwargs):
        started = time.perf_counter()
        try:
            result = function(*args, **kwargs)
            self.data["steps"].append({"step": name, "ok": True, "seconds": round(time.perf_counter() - started, 1)})
            return result
        except Exception as exc:  # a finding; the next step runs
            traceback.print_exc()
            self.data["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:400])
            self.data["steps"].append({"step": name, "ok": False, "seconds": round(time.perf_counter() - started, 1)})
            return None
        finally:
            self.save()


def weight_bytes_per_token(shape: str, fmt: str) -> int:
    """GPU bytes of weights one decode step reads: all but the embedding (exllamav2 keeps it on the CPU)."""
    s = SHAPES[shape]
    return layout(s, fmt)["bytes"] - 2 * s.vocab * s.hidden


def bandwidth(args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    elements = args.probe_mib * (1 << 20) // 2
    x = torch.ones(elements, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    rounds = []
    for _ in range(args.probe_reps + 2):
        sync(torch)
        started = time.perf_counter()
        y.copy_(x)
        sync(torch)
        rounds.append(time.perf_counter() - started)
    seconds = statistics.median(rounds[2:])
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {"device": name, "bytes_copied": 2 * x.numel() * 2, "gb_s": round(4 * x.numel() / seconds / 1e9, 1)}


def sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def direct(args, report: Report) -> None:
    from bench.gpu.rates import Direct

    providers = args.providers.split(",")
    report.data.update(weight_bytes_per_token=weight_bytes_per_token(args.shape, args.format), providers=providers)
    started = time.perf_counter()
    loaded = report.step("load", Direct, args.model, providers[0], args.context, max(args.streams), args.cache_tokens)
    if loaded is None:
        return
    report.data.update(load_s=round(time.perf_counter() - started, 1), provider_imported=loaded.provider,
                       paged=loaded.sizes.paged, cache_tokens=loaded.sizes.cache_tokens)
    report.data["load_check"] = report.step("load_check", load_check, loaded)
    report.data["attention"] = report.step("attention alone", attention_alone, loaded.torch, providers, args.streams,
                                           args.attention_calls)
    report.data["raw_forward"] = report.step("raw_forward", raw_forward, loaded, args.warmup_steps, args.tokens)
    bos = [loaded.tokenizer.bos_token_id]
    prompt_ids = [bos + loaded.tokenizer.encode(p, add_bos=False).flatten().tolist() for p in rate_prompts(max(args.streams))]
    report.data["direct_tok_s"] = {}
    attn = importlib.import_module("exllamav2.attn")
    for index, provider in enumerate(providers):
        function = report.step(f"provider {provider}", provider_function, provider)
        if function is None:
            continue
        attn.flash_attn_with_kvcache = function  # what every paged forward calls from here on
        warmup = args.warmup_steps if index == 0 else 16
        report.step(f"warm-up {provider}", warm_up, loaded, prompt_ids, warmup, max(args.streams))
        rates: dict[str, float] = {}
        report.data["direct_tok_s"][provider] = rates
        for count in args.streams:
            rate = report.step(f"direct {provider} {count}", lambda c=count: statistics.median(
                loaded.together(prompt_ids, c, args.tokens) for _ in range(args.reps)))
            if rate is not None:
                rates[str(count)] = round(rate, 1)
                print(f"  direct on {provider}, {count} streams: {rate:.1f} tok/s", flush=True)
    loaded.model.unload()


def provider_function(provider: str):
    return importlib.import_module(PROVIDERS[provider]).flash_attn_with_kvcache


def warm_up(loaded, prompt_ids: list[list[int]], single_steps: int, most: int) -> None:
    loaded.together(prompt_ids, 1, single_steps)
    loaded.together(prompt_ids, most, 16)


def attention_alone(torch, providers: list[str], streams: list[int], calls: int, keys: int = 272) -> dict:
    """One decode step's attention call at Llama-3-8B's shape (32/8 heads, head dim 128, 256-token
    pages, `keys` keys a sequence) on each provider: the largest difference from the first provider's
    output, and milliseconds per call (a step makes one per layer, 32)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    out: dict = {}
    for count in streams:
        pages = -(-(keys + 1) // 256)
        gen = torch.Generator(device=device).manual_seed(count)
        k_cache = torch.randn(count * pages + 1, 256, 8, 128, generator=gen, device=device, dtype=dtype)
        v_cache = torch.randn(count * pages + 1, 256, 8, 128, generator=gen, device=device, dtype=dtype)
        table = (torch.randperm(count * pages, generator=gen, device=device) + 1).to(torch.int32).view(count, pages)
        q = torch.randn(count, 1, 32, 128, generator=gen, device=device, dtype=dtype)
        k, v = (torch.randn(count, 1, 8, 128, generator=gen, device=device, dtype=dtype) for _ in range(2))
        lengths = torch.full((count,), keys, dtype=torch.int32, device=device)
        arguments = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=lengths, block_table=table,
                         causal=True, softmax_scale=128**-0.5)  # the same rows appended each call: the cache settles
        results, first = {}, None
        for provider in providers:
            function = provider_function(provider)
            result = function(**arguments)
            first = result if first is None else first
            sync(torch)
            started = time.perf_counter()
            for _ in range(calls):
                function(**arguments)
            sync(torch)
            seconds = time.perf_counter() - started
            results[provider] = {"ms_per_call": round(seconds * 1000 / calls, 3) if calls else None,
                                 "max_diff": float(f"{float((result.float() - first.float()).abs().max()):.3g}")}
        out[str(count)] = results
        print(f"  attention alone, {count} streams: {results}", flush=True)
    return out


def load_check(loaded) -> dict:
    """One forward of a short prompt: finite logits over the model's whole vocabulary."""
    torch = loaded.torch
    ids = loaded.tokenizer.encode("The history of the printing press", add_bos=True)
    logits = loaded.model.forward(ids).float()
    finite = bool(torch.isfinite(logits).all())
    if not finite:
        raise AssertionError(f"the model's logits are not finite ({logits.flatten()[:4].tolist()} ...)")
    return {"finite": finite, "vocab": int(logits.shape[-1]), "std": round(float(logits.std()), 3)}


def raw_forward(loaded, warmup_steps: int, steps: int) -> dict:
    """exllamav2's own forward, one token at a time into an unpaged cache, with its own attention (the
    model's no_flash_attn flag set meanwhile, so no provider of ours is called): the GPU's pace at one
    stream with nothing of ours in the loop, synchronised once at the end."""
    torch, exllamav2 = loaded.torch, loaded.exllamav2
    config = loaded.model.config
    cache = exllamav2.ExLlamaV2Cache(loaded.model, max_seq_len=max(256, -(-(warmup_steps + steps + 2) // 256) * 256))
    token = loaded.tokenizer.encode("The", add_bos=True)[:, -1:]
    was = config.no_flash_attn
    config.no_flash_attn = True
    try:
        for _ in range(warmup_steps):
            loaded.model.forward(token, cache)
        sync(torch)
        started = time.perf_counter()
        for _ in range(steps):
            loaded.model.forward(token, cache)
        sync(torch)
        seconds = time.perf_counter() - started
    finally:
        config.no_flash_attn = was
    return {"tok_s": round(steps / seconds, 1), "steps": steps, "warmup_steps": warmup_steps}


def grpc(args, report: Report) -> None:
    import grpc as grpc_lib

    from bench.gpu.rates import grpc_rates
    from tests.harness.servers import start_server, stop_server
    from tokenspout.v1 import generation_pb2 as pb
    from tokenspout.v1 import generation_pb2_grpc as pb_grpc

    report.data.update(weight_bytes_per_token=weight_bytes_per_token(args.shape, args.format), attention=args.attention)
    flags = ("--engine", "exllamav2", "--model", str(args.model), "--context-length", str(args.context),
             "--max-batch-size", str(max(args.streams)), "--attention", args.attention, "--model-id", args.format)
    if args.cache_tokens:
        flags += ("--cache-tokens", str(args.cache_tokens))
    started = time.perf_counter()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="tokenspout-real-"))
    paced = ("--step-s", "0.02") if args.fake_engine else ()  # the scripted engine at an 8B model's pace
    server = report.step("server start", start_server, scratch, *flags, timeout_s=args.start_s, faults=paced,
                         fake_engine=args.fake_engine)
    if server is None:
        return
    report.data["load_s"] = round(time.perf_counter() - started, 1)
    try:
        with grpc_lib.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            report.data.update(engine=info.engine, attention_provider=info.attention_provider)
            warmup = ((1, args.warmup_steps), (max(args.streams), 16))
            measured = report.step("gRPC rates", grpc_rates, stub, args.streams, args.tokens, args.reps, warmup)
            if measured:
                report.data["grpc_tok_s"] = {n: round(r, 1) for n, r in measured["tok_s"].items()}
                report.data["engine_steps"] = measured["engine_steps"]
    finally:
        report.step("server stop", stop_server, server)
        report.data["server_log_tail"] = server.log()[-2000:]
        report.save()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layer", choices=("bandwidth", "direct", "grpc"))
    parser.add_argument("model", type=pathlib.Path, nargs="?")
    parser.add_argument("--json", type=pathlib.Path, required=True)
    parser.add_argument("--format", choices=("exl2", "gptq", "fp16"), default="exl2")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the shape make_random_model wrote")
    parser.add_argument("--streams", type=lambda text: [int(n) for n in text.split(",")], default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream per run")
    parser.add_argument("--reps", type=int, default=2, help="runs per stream count (the median)")
    parser.add_argument("--warmup-steps", type=int, default=240, help="single-stream steps before timing")
    parser.add_argument("--context", type=int, default=2048, help="context_length (the generator's max_seq_len)")
    parser.add_argument("--cache-tokens", type=int, default=64 * 512, help="the paged cache's tokens (0: the engine's default)")
    parser.add_argument("--providers", default="triton,sdpa", help="direct: paged attention providers, in order")
    parser.add_argument("--attention-calls", type=int, default=20,
                        help="direct: timed calls of each provider alone at the 8B attention shape (0: compared, not timed)")
    parser.add_argument("--attention", default="triton", help="grpc: the server's attention setting")
    parser.add_argument("--fake-engine", action="store_true",
                        help="grpc: serve tests/harness/fake_engine.py's scripted engine instead (the CPU rehearsal)")
    parser.add_argument("--start-s", type=float, default=180, help="grpc: the most seconds the server may take to start")
    parser.add_argument("--probe-mib", type=int, default=2048, help="bandwidth: MiB copied per round")
    parser.add_argument("--probe-reps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.layer != "bandwidth" and args.model is None:
        parser.error(f"{args.layer} needs a model directory")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    report = Report(args.json, layer=args.layer, format=args.format, shape=args.shape, model=str(args.model or ""),
                    streams=args.streams, tokens=args.tokens, reps=args.reps, warmup_steps=args.warmup_steps)
    if args.layer == "bandwidth":
        report.data["bandwidth"] = report.step("copy probe", bandwidth, args)
        report.save()
    else:
        report.step(args.layer, direct if args.layer == "direct" else grpc, args, report)
    return 0 if not report.data["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
