"""exllamav2's paged generator on tokenspout's SDPA paged attention, against its own unpaged path.

For each model directory, in one process: exllamav2 imported through
backend.exllamav2.attention_provider with setting `sdpa`, then the same greedy jobs run twice:

* reference: `config.no_flash_attn = True` and `paged=False`: exllamav2's own attention, one job
  at a time, never our provider (its call count must stay 0);
* paged: the default config, `paged=True`, several jobs per forward pass on our provider.

Asserted, and written to --json after every model: every job's token ids the same both ways (or
parting only where the reference's top two logits were a near tie, which FP16 rounding may flip);
at least 4 jobs active in one iterate(); at least 2 sequences in one flash_attn_with_kvcache call;
the second of two jobs sharing a prompt prefix of more than a page starting from at least one
whole cached page; the provider named `sdpa`.

    python bench/gpu/paged_smoke.py MODEL_DIR [MODEL_DIR ...] --json OUT.json   # exit 1 if any fails
    python bench/gpu/paged_smoke.py --self-check    # the comparison and the report, no torch, no GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.ties import TIE_MARGIN  # noqa: E402

PROVIDER_SETTING = "sdpa"
PAGE = 256  # exllamav2's page: a shared prefix longer than this shares whole pages
NEW_TOKENS = 32
SHARED_PREFIX_TOKENS = 300  # BOS + 299 tokens: page 0 whole, page 1 partly
PAGED_CACHE_TOKENS = 4 * 1024  # a multiple of the page (dynamic.py asserts it)
PAGED_BATCH = 8  # all five jobs at once
CHUNK = 256  # prefill chunk, a multiple of the page: the shared prompts take two chunks each
MIN_ACTIVE_JOBS = 4
MIN_ATTENTION_BATCH = 2
PASSAGE = " ".join(
    f"Chapter {i}: the printing press let a town print books, pamphlets and news far faster than scribes."
    for i in range(60)
)


# ---- the pure parts: what is compared and how it is reported (no torch; --self-check) ----

def job_prompts(encode) -> dict[str, list[int]]:
    """Five prompts as token ids (BOS first), the first two sharing SHARED_PREFIX_TOKENS tokens;
    `encode(text)` gives ids without BOS, `encode(None)` the BOS id alone in a list."""
    bos = encode(None)
    passage = encode(PASSAGE)
    shared = bos + passage[: SHARED_PREFIX_TOKENS - len(bos)]
    assert len(shared) == SHARED_PREFIX_TOKENS, f"the passage gave only {len(passage)} tokens"
    return {
        "shared-a": shared + encode(" Which chapter came first?"),
        "shared-b": shared + encode(" Name a town from it."),
        "short": bos + encode("Once upon a time"),
        "medium": bos + encode("The history of the printing press " * 12),
        "long": bos + passage[-(2 * PAGE + 20):],  # three pages, its own
    }


def compare_job(reference: list[int], paged: list[int], margins: list[float]) -> dict:
    """One job's tokens both ways: where they part, and whether that was at a near tie of the reference."""
    agree = next((i for i, (a, b) in enumerate(zip(reference, paged)) if a != b), min(len(reference), len(paged)))
    identical = reference == paged and len(reference) == NEW_TOKENS
    parted_at_tie = not identical and agree < min(len(reference), len(paged), len(margins)) and margins[agree] < TIE_MARGIN
    return {
        "identical": identical,
        "agree": agree,
        "parted_at_tie": parted_at_tie,
        "tokens": [len(reference), len(paged)],
        "min_margin": round(min(margins), 4) if margins else None,
        "margin_at_parting": round(margins[agree], 4) if not identical and agree < len(margins) else None,
    }


def failures_of(result: dict) -> list[str]:
    """What one model's smoke result fails of the assertions above; empty when it passes."""
    problems = []
    if result.get("provider") != PROVIDER_SETTING:
        problems.append(f"provider {result.get('provider')!r}, not {PROVIDER_SETTING!r}")
    jobs = result.get("jobs", {})
    if not jobs:
        problems.append("no jobs compared")
    for name, job in jobs.items():
        if job["tokens"] != [NEW_TOKENS, NEW_TOKENS]:
            problems.append(f"{name}: {job['tokens']} tokens (reference, paged), expected {NEW_TOKENS} each")
        elif not job["identical"] and not job["parted_at_tie"]:
            problems.append(f"{name}: paged parts from unpaged at token {job['agree']}, "
                            f"where the reference's top two are {job['margin_at_parting']} apart")
    if result.get("max_active_jobs", 0) < MIN_ACTIVE_JOBS:
        problems.append(f"at most {result.get('max_active_jobs', 0)} jobs active in one iterate (needs {MIN_ACTIVE_JOBS})")
    stats = result.get("provider_stats", {})
    if stats.get("largest_kvcache_batch", 0) < MIN_ATTENTION_BATCH:
        problems.append(f"at most {stats.get('largest_kvcache_batch', 0)} sequences in one paged attention call")
    if not stats.get("paged_calls"):
        problems.append("no attention call went through a block table")
    if result.get("reference_provider_calls", 0):
        problems.append(f"the unpaged reference called our provider {result['reference_provider_calls']} times")
    if result.get("shared_prefix_cached_tokens", 0) < PAGE:
        problems.append(f"the second shared-prefix job reused {result.get('shared_prefix_cached_tokens', 0)} "
                        f"cached tokens (needs a whole page, {PAGE})")
    return problems


def summary_of(result: dict) -> str:
    jobs = result.get("jobs", {}).values()
    identical = sum(j["identical"] for j in jobs)
    at_tie = sum(j["parted_at_tie"] for j in jobs)
    stats = result.get("provider_stats", {})
    return (f"{identical}/{len(jobs)} identical{f' ({at_tie} parted at a near tie)' if at_tie else ''}, "
            f"{result.get('max_active_jobs', 0)} jobs at once, {stats.get('largest_kvcache_batch', 0)} sequences "
            f"per attention call, {result.get('shared_prefix_cached_tokens', 0)} prefix tokens reused")


def write_report(path: pathlib.Path | None, report: dict) -> None:
    """The whole report, replaced at once: a stage killed at its limit leaves the last complete one."""
    if path is None:
        return
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=pathlib.Path, nargs="*", help="model directories (fp16, gptq, exl2)")
    parser.add_argument("--json", type=pathlib.Path, help="where to write the report")
    parser.add_argument("--self-check", action="store_true", help="check the pure parts and exit")
    args = parser.parse_args(argv)
    if not args.models and not args.self_check:
        parser.error("name at least one model directory")
    return args


# ---- the GPU parts ----

def run_jobs(exllamav2, model_dir: pathlib.Path, prompts: dict[str, list[int]], paged: bool) -> dict:
    """The greedy jobs through one generator: each job's token ids, the reference's top-two logit
    gaps per token, what each reused from the cache, and the most jobs active in one iterate()."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    config = exllamav2.ExLlamaV2Config(str(model_dir))
    config.arch_compat_overrides()
    config.no_flash_attn = not paged  # unpaged: exllamav2's own attention, not a flash_attn
    model = exllamav2.ExLlamaV2(config)
    cache_tokens = PAGED_CACHE_TOKENS if paged else config.max_seq_len
    cache = exllamav2.ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache)
    tokenizer = exllamav2.ExLlamaV2Tokenizer(config)
    generator = ExLlamaV2DynamicGenerator(
        model=model, cache=cache, tokenizer=tokenizer, paged=paged,
        max_batch_size=PAGED_BATCH if paged else 1, max_chunk_size=CHUNK,
    )
    vocab = config.vocab_size
    tokens = {name: [] for name in prompts}
    margins = {name: [] for name in prompts}
    cached = {}
    for name, ids in prompts.items():
        generator.enqueue(ExLlamaV2DynamicJob(
            input_ids=torch.tensor([ids], dtype=torch.long), max_new_tokens=NEW_TOKENS, stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(), return_logits=True, identifier=name,
        ))
    most_active, iterations = 0, 0
    while generator.num_remaining_jobs():
        results = generator.iterate()
        iterations += 1
        most_active = max(most_active, len(generator.active_jobs))
        for result in results:
            name = result.get("identifier")
            if result.get("token_ids") is not None:
                tokens[name] += result["token_ids"].flatten().tolist()
            if result.get("logits") is not None:
                top = result["logits"].reshape(-1, result["logits"].shape[-1])[:, :vocab].float().topk(2, dim=-1).values
                margins[name] += (top[:, 0] - top[:, 1]).tolist()
            if result.get("eos"):
                cached[name] = result.get("cached_tokens", 0)
    model.unload()
    return {"tokens": tokens, "margins": margins, "cached_tokens": cached, "max_active_jobs": most_active,
            "iterations": iterations}


def free_gpu() -> None:
    """What the last run held (its cache, its generator's buffers) off the GPU before the next load."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def smoke(exllamav2, provider: str, model_dir: pathlib.Path) -> dict:
    from backend.exllamav2 import paged_attention

    started = time.perf_counter()
    tokenizer = exllamav2.ExLlamaV2Tokenizer(exllamav2.ExLlamaV2Config(str(model_dir)))
    prompts = job_prompts(lambda text: [tokenizer.bos_token_id] if text is None
                          else tokenizer.encode(text, add_bos=False).flatten().tolist())
    paged_attention.stats.reset()
    reference = run_jobs(exllamav2, model_dir, prompts, paged=False)
    free_gpu()
    reference_calls = paged_attention.stats.calls
    reference_s = time.perf_counter() - started
    paged_attention.stats.reset()
    paged = run_jobs(exllamav2, model_dir, prompts, paged=True)
    free_gpu()
    return {
        "variant": model_dir.name,
        "model": str(model_dir),
        "provider": provider,
        "prompt_tokens": {name: len(ids) for name, ids in prompts.items()},
        "jobs": {
            name: compare_job(reference["tokens"][name], paged["tokens"][name], reference["margins"][name])
            for name in prompts
        },
        "max_active_jobs": paged["max_active_jobs"],
        "reference_max_active_jobs": reference["max_active_jobs"],
        "provider_stats": paged_attention.stats.snapshot(),
        "reference_provider_calls": reference_calls,
        "cached_tokens": paged["cached_tokens"],
        "shared_prefix_cached_tokens": paged["cached_tokens"].get("shared-b", 0),
        "iterations": {"reference": reference["iterations"], "paged": paged["iterations"]},
        "seconds": {"reference": round(reference_s, 1), "paged": round(time.perf_counter() - started - reference_s, 1)},
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.self_check:
        return self_check()
    report = {"kind": "paged_smoke", "provider": None, "ok": False, "models": [], "errors": []}
    try:
        import torch

        from backend.exllamav2.attention_provider import import_exllamav2

        started = time.perf_counter()
        exllamav2, provider = import_exllamav2(PROVIDER_SETTING)
        report.update(provider=provider, import_s=round(time.perf_counter() - started, 1),
                      exllamav2=exllamav2.__version__, torch=torch.__version__,
                      gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
        print(f"exllamav2 {exllamav2.__version__} imported with attention {provider!r} in {report['import_s']} s", flush=True)
    except Exception as exc:  # nothing can run without it; say why
        traceback.print_exc()
        report["errors"].append(f"import: {type(exc).__name__}: {exc}"[:400])
        write_report(args.json, report)
        return 1
    for model_dir in args.models:
        try:
            result = smoke(exllamav2, provider, model_dir)
        except Exception as exc:  # one model's failure is a finding; the next still runs
            traceback.print_exc()
            result = {"variant": model_dir.name, "model": str(model_dir), "provider": provider,
                      "error": f"{type(exc).__name__}: {exc}"[:400]}
        result["failures"] = [result["error"]] if "error" in result else failures_of(result)
        result["ok"] = not result["failures"]
        report["models"].append(result)
        report["ok"] = all(m["ok"] for m in report["models"]) and not report["errors"]
        write_report(args.json, report)
        verdict = summary_of(result) if "error" not in result else result["error"]
        print(f"{'PASS' if result['ok'] else 'FAIL'} paged smoke {model_dir.name}: {verdict}", flush=True)
        for problem in result["failures"]:
            print(f"  {problem}", flush=True)
    return 0 if report["ok"] else 1


def self_check() -> int:
    """The comparison, the verdict and the report on made-up results: what can be checked without a GPU."""
    words = {}

    def encode(text):  # one id per word, BOS 0
        return [0] if text is None else [words.setdefault(w, len(words) + 1) for w in text.split()]

    prompts = job_prompts(encode)
    assert prompts["shared-a"][:SHARED_PREFIX_TOKENS] == prompts["shared-b"][:SHARED_PREFIX_TOKENS]
    assert prompts["shared-a"][SHARED_PREFIX_TOKENS:] != prompts["shared-b"][SHARED_PREFIX_TOKENS:]
    assert len(prompts["long"]) > 2 * PAGE and all(ids[0] == 0 for ids in prompts.values())
    same, wide = list(range(NEW_TOKENS)), [0.5] * NEW_TOKENS
    assert compare_job(same, same, wide)["identical"]
    parted = same[:7] + [999] * (NEW_TOKENS - 7)
    assert not compare_job(same, parted, wide)["parted_at_tie"]
    tie = compare_job(same, parted, wide[:7] + [0.001] + wide[8:])
    assert tie["parted_at_tie"] and tie["agree"] == 7 and tie["margin_at_parting"] == 0.001
    good = {"provider": PROVIDER_SETTING, "jobs": {"a": compare_job(same, same, wide), "b": tie},
            "max_active_jobs": 5, "provider_stats": {"largest_kvcache_batch": 5, "paged_calls": 40},
            "reference_provider_calls": 0, "shared_prefix_cached_tokens": 299}
    assert failures_of(good) == [], failures_of(good)
    assert "1/2 identical (1 parted at a near tie)" in summary_of(good)
    bad = {**good, "provider": "none", "max_active_jobs": 1, "provider_stats": {"largest_kvcache_batch": 1},
           "reference_provider_calls": 3, "shared_prefix_cached_tokens": 0,
           "jobs": {"a": compare_job(same, parted, wide), "b": compare_job(same, same[:-1], wide)}}
    assert len(failures_of(bad)) == 8, failures_of(bad)
    with tempfile.TemporaryDirectory() as scratch:
        path = pathlib.Path(scratch) / "smoke.json"
        write_report(path, {"kind": "paged_smoke", "models": [good]})
        assert json.loads(path.read_text())["models"][0]["jobs"]["b"]["agree"] == 7
        assert not path.with_suffix(".json.tmp").exists()
    assert parse_args(["a", "b", "--json", "x.json"]).models == [pathlib.Path("a"), pathlib.Path("b")]
    assert "torch" not in sys.modules, "the self-check must run without torch"
    print("paged_smoke self-check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
