"""Keyword arguments for one `ExLlamaV2DynamicJob`, every one set on purpose."""

from __future__ import annotations

from backend.types import GenerationRequest


def heals(request: GenerationRequest) -> bool:
    """Whether exllamav2 heals this job: 0.3.2 heals only prompts longer than one token (dynamic.py:1709)."""
    return request.sampling.token_healing and len(request.prompt_token_ids) > 1


def job_input(request: GenerationRequest, output: tuple[int, ...] = ()) -> list[int]:
    """The job's input_ids: the prompt, or for a job that continues a preempted one, the sequence that
    one held (a healed job holds the prompt without its last token, which its first output replaced)."""
    prompt = request.prompt_token_ids
    if output and heals(request):
        prompt = prompt[:-1]
    return [*prompt, *output]


def job_fields(request: GenerationRequest, eos_token_ids: tuple[int, ...], generated: int = 0) -> dict[str, object]:
    """Everything but `input_ids`, `gen_settings` and `filters` (which need torch and exllamav2);
    `generated`: the tokens a preempted job output before this one continues it."""
    stopping = request.stopping
    # exllamav2 adds no EOS of its own: every EOS id must be a stop condition, unless ignored
    # (then the sampler settings also bias them to -inf: see settings.token_bias_values).
    stop_ids = set(stopping.stop_token_ids) | (set() if stopping.ignore_eos else set(eos_token_ids))
    # A healed job counts from -1: the regenerated last prompt token comes first, and it is ours to count.
    healed = int(heals(request) and not generated)
    return {
        "max_new_tokens": stopping.max_new_tokens - healed - generated,
        "min_new_tokens": max(stopping.min_new_tokens - healed - generated, 0),
        "seed": request.sampling.seed,
        "stop_conditions": [*stopping.stop_sequences, *sorted(stop_ids)],
        "decode_special_tokens": False,
        # The contract's logprobs come from the logits exllamav2 sampled from: they are after
        # repetition penalties, logit bias, DRY and the grammar mask (sampler.py:408-444, 517; not the
        # raw logits), before temperature and truncation. Its own probs are after truncation.
        "return_probs": False,
        "return_top_tokens": 0,
        "return_logits": request.output.return_logprobs or request.output.top_logprobs > 0,
        "token_healing": bool(healed),
        # Validation refuses both with a constraint: they bypass exllamav2's filters.
        "banned_strings": list(request.sampling.banned_strings) or None,
        "identifier": request.request_id,
    }
