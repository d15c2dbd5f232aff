"""Decode tokens/s of greedy streams run together with exllamav3 driven directly: its model, cache and
Generator built as the exllamav3 engine builds them (backend.exllamav3), the same prompts' ids as through
gRPC, the same window (bench/gpu/rates.py). check.py --engine exllamav3 runs it in a child process and
divides the gRPC rates by these."""

from __future__ import annotations

import pathlib
import statistics

from bench.gpu.rates import BATCH, CONTEXT, RATE_REPS, RATE_STREAMS, RATE_TOKENS, generator_rate


def direct_rates(model_dir: pathlib.Path, prompt_ids: list[list[int]], streams=RATE_STREAMS,
                 tokens: int = RATE_TOKENS, reps: int = RATE_REPS) -> dict:
    from backend.config import EngineConfig, EngineKind
    from backend.exllamav3.binding import import_classes
    from backend.exllamav3.engine import ATTENTION_PROVIDER
    from backend.exllamav3.loading import load
    from backend.exllamav3.sizes import generator_fields, generator_sizes, speculation

    classes = import_classes()
    torch, sampling = classes.torch, classes.sampling
    config = EngineConfig(kind=EngineKind.EXLLAMAV3, model=str(model_dir), context_length=CONTEXT, max_batch_size=BATCH)
    sizes, drafts = generator_sizes(config), speculation(config, False)
    loaded = load(classes, model_dir, config, sizes, drafts)
    generator = classes.generator(model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer,
                                  **generator_fields(sizes, drafts, config.exllamav3))

    def together(count: int, length: int) -> float:
        for i, ids in enumerate(prompt_ids[:count]):
            generator.enqueue(classes.job(
                input_ids=torch.tensor([ids], dtype=torch.long), max_new_tokens=length, stop_conditions=[],
                sampler=sampling.CustomSampler([sampling.SS_Argmax()]), identifier=i,
            ))
        return generator_rate(generator, count, length)

    together(max(streams), 16)  # warm-up, as through gRPC (and Triton's kernels compiled for these shapes)
    rates = {}
    for count in streams:
        rates[str(count)] = statistics.median(together(count, tokens) for _ in range(reps))
        print(f"  exllamav3 directly, {count} streams: {rates[str(count)]:.1f} tok/s", flush=True)
    generator.close()
    loaded.model.unload()
    return {"tok_s": rates, "provider": ATTENTION_PROVIDER, "paged": True, "setting": "exllamav3"}
