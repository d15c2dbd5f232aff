"""Keyword arguments for one generator job, every one set on purpose.

exllamav2 0.3.2's ExLlamaV2DynamicJob and exllamav3 1.6.5's Job take the same names for all of these
(both swallow unknown keywords silently: the tests check each against their sources).
"""

from __future__ import annotations

from backend.types import GenerationRequest


def heals(request: GenerationRequest) -> bool:
    """Whether the job heals the prompt's last token. Both generations heal only prompts longer than one
    token (0.3.2 dynamic.py:1709, 1.6.5 job.py Job.__init__); here also only where two tokens or more may
    follow: the healed token counts within max_new_tokens, and exllamav3 asserts a job may make one more."""
    return request.sampling.token_healing and len(request.prompt_token_ids) > 1 and request.stopping.max_new_tokens > 1


def job_input(request: GenerationRequest, output: tuple[int, ...] = ()) -> list[int]:
    """The job's input_ids: the prompt, or for a job that continues a preempted one, the sequence that
    one held (a healed job holds the prompt without its last token, which its first output replaced)."""
    prompt = request.prompt_token_ids
    if output and heals(request):
        prompt = prompt[:-1]
    return [*prompt, *output]


def job_fields(request: GenerationRequest, eos_token_ids: tuple[int, ...], generated: int = 0) -> dict[str, object]:
    """Everything but `input_ids`, the sampler and `filters` (which need torch and the library);
    `generated`: the tokens a preempted job output before this one continues it."""
    stopping = request.stopping
    # Neither generation adds an EOS of its own: every EOS id must be a stop condition, unless ignored
    # (then the sampler also biases them to -inf: see each binding's sampler).
    stop_ids = set(stopping.stop_token_ids) | (set() if stopping.ignore_eos else set(eos_token_ids))
    # A healed job counts from -1: the regenerated last prompt token comes first, and it is ours to count.
    healed = int(heals(request) and not generated)
    return {
        "max_new_tokens": stopping.max_new_tokens - healed - generated,
        "min_new_tokens": max(stopping.min_new_tokens - healed - generated, 0),
        "seed": request.sampling.seed,
        "stop_conditions": [*stopping.stop_sequences, *sorted(stop_ids)],
        "decode_special_tokens": False,
        # The contract's logprobs come from the logits the generator returns with each token (see each
        # binding's docstring for what they are after), not from its own probs, which are after truncation.
        "return_probs": False,
        "return_top_tokens": 0,
        "return_logits": request.output.return_logprobs or request.output.top_logprobs > 0,
        "token_healing": bool(healed),
        # Validation refuses both with a constraint: the jobs' filters do not see them.
        "banned_strings": list(request.sampling.banned_strings) or None,
        "identifier": request.request_id,
    }
