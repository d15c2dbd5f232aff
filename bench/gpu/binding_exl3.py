"""exllamav3 1.6.5's own classes taking what the exllamav3 binding gives them, no GPU needed: a model folder's
Config, Model (not loaded), Cache and Tokenizer; a Job with every sampler the engine maps, as a CustomSampler
of exllamav3's steps, and our grammar filter on exllamav3's Filter base; a Generator built, the job enqueued
(its pages counted) and cancelled, the generator retired. Run by bench/gpu/stages_exl3.sh before serving (the
CPU rehearsal runs it over a stand-in extension); the doubles the CPU tests use are checked against the same
source by tests/backend/exllamav3/test_signatures.py.

    python bench/gpu/binding_exl3.py MODEL_DIR
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # run as a file on the GPU machine, beside no installed tokenspout

from backend.config import EngineConfig, EngineKind  # noqa: E402
from backend.constraints import ConstraintCompiler, ConstraintSpec  # noqa: E402
from backend.exllama.model_files import end_token_ids  # noqa: E402
from backend.exllama.vocabulary import folder_vocabulary  # noqa: E402
from backend.exllamav3.binding import ExLlamaV3Binding, Loaded, import_classes  # noqa: E402
from backend.exllamav3.sampler import SUPPORTED_SAMPLERS  # noqa: E402
from backend.exllamav3.sizes import cache_fields, generator_sizes, speculation  # noqa: E402
from backend.types import (  # noqa: E402
    DryParams,
    GenerationRequest,
    OutputParams,
    SamplingParams,
    StopParams,
    XtcParams,
)

EVERY_SAMPLER = SamplingParams(
    temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
    frequency_penalty=0.1, penalty_last_n=64, seed=3, logit_bias={5: 2.0}, dry=DryParams(multiplier=0.8),
    xtc=XtcParams(probability=0.5), banned_strings=("As an AI",), token_healing=True,
)


def check(model_dir: pathlib.Path) -> list[str]:
    classes = import_classes()
    config = EngineConfig(kind=EngineKind.EXLLAMAV3, context_length=1024, max_batch_size=4)
    sizes, drafts = generator_sizes(config), speculation(config, False)
    model_config = classes.config.from_directory(str(model_dir))
    model = classes.model.from_config(model_config)
    cache = classes.cache(model, layer_type=classes.fp16_layer, **cache_fields(sizes, drafts, config.exllamav3))
    tokenizer = classes.tokenizer.from_config(model_config)
    eos = end_token_ids(model_dir, tokenizer.eos_token_id)
    vocabulary, _ = folder_vocabulary(model_dir, model_config.vocab_size, tokenizer.bos_token_id, eos)
    binding = ExLlamaV3Binding(classes, Loaded(model_config, model, cache, tokenizer, {}), sizes, drafts,
                               config.exllamav3, eos)
    seen = []
    prompt = tuple(vocabulary.tokenize("Hello there, the sea"))
    request = GenerationRequest("every", prompt, EVERY_SAMPLER, StopParams(16, 2, ("\n",)), OutputParams(True, True, 2))
    assert EVERY_SAMPLER.in_effect() <= set(SUPPORTED_SAMPLERS)
    job, _ = binding.new_job(request, None, None)
    steps = [type(step).__name__ for step in job.sampler.steps]
    assert job.max_new_tokens == 15 and job.prefix_token is not None, "token healing: one of the 16 is the healed one"
    seen.append(f"a job with every sampler: {len(steps)} steps ({', '.join(dict.fromkeys(steps))})")
    compiled = ConstraintCompiler(vocabulary.ll_tokenizer).compile(ConstraintSpec("regex", "[0-9]{3}"))
    constrained, _ = binding.new_job(GenerationRequest("json", prompt, SamplingParams(temperature=0.0)), None, compiled)
    shell = constrained.filters[0]
    shell.reset()
    mask = shell.get_next_logit_mask()
    assert str(mask.dtype) == "torch.int32" and tuple(mask.shape) == (1, -(-model_config.vocab_size // 32)), mask.shape
    ends = [shell.feed(token) for token in vocabulary.encode_plain("123")]
    assert ends[-1] is True and not shell.is_active, ends  # completed: exllamav3 ends the job ("end_filter")
    seen.append(f"a constrained job: its filter on exllamav3's Filter, a {tuple(mask.shape)} int32 mask, ends on completion")
    generator = binding.new_generator()
    generator.enqueue(job)
    pages = len(binding.pages(generator))
    assert generator.num_remaining_jobs() == 1 and pages == sizes.cache_tokens // binding.page_size
    generator.cancel(job)
    assert generator.num_remaining_jobs() == 0
    binding.retire(generator)
    seen.append(f"a Generator over {pages} pages: the job enqueued and cancelled, the generator closed")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=pathlib.Path)
    for line in check(parser.parse_args().model):
        print(f"  PASS {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
