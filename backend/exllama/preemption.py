"""Recompute preemption for the exllama generators: who may give way, who does, and the job that continues it.

Neither generator can pause a job, so a job gives its batch place by being cancelled (its pages go
back to the generator, keeping their keys and values), and comes back later as a new job whose
prompt is the old one's prompt and output. Both find full pages again by the hash of the tokens
they hold (exllamav2 also copies a partial last page from the best match), so while the cache has
not reused them the comeback computes little (exllamav2 unpaged: a page is the whole cache, and it
computes everything again, which the fairness policy weighs as the cost of bringing it back). The
caller's stream goes on where it was: no token is repeated or dropped, because a job gives way
only at a clean boundary:

- nothing held: no text or token held back for a partial stop string, a partial banned string
  (no checkpoint) or an incomplete UTF-8 character. Everything the job sampled has then reached
  the caller, so the new job's input is exactly the old job's sequence, and the new job's empty
  hold buffer is the old one's;
- no constraint. The grammar matcher would have to go on in the new job, but exllamav2 keeps a
  cancelled job's filter queued for a background mask on its filter threads (generator.filter_queue),
  so the old job would still touch the matcher while the new one uses it; exllamav3 resets a new
  job's filters when it starts it (Job.activate). Constrained jobs hold their place until they end
  (a more urgent request takes the next free one).

The new job also carries the old one's random generator (a seeded request samples the same
sequence either way) and sampler (exllamav2's settings carry mirostat's state), heals no token,
and counts max_new_tokens and min_new_tokens from the output so far (backend.exllama.job_fields).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend.common.fairness import FairnessPolicy, caller_of
from backend.exllama.job import JobFactory, Resume, SampleJob


def holds_nothing(job: Any) -> bool:
    """Whether a generator job holds no text, no tokens and no banned-string checkpoint (the same three
    attributes in exllamav2 0.3.2's ExLlamaV2DynamicJob, dynamic.py:1560-1593, and exllamav3 1.6.5's Job)."""
    return not job.held_text and not len(job.held_tokens) and job.checkpoint is None


def may_give_way(entry: SampleJob) -> bool:
    return entry.request.constraint is None and holds_nothing(entry.job)


def comeback_cost(entry: SampleJob, page_size: int) -> int:
    """The tokens its comeback computes again while its pages stay cached: those past its last full page."""
    return len(entry.tokens) % page_size


def victim_for(
    policy: FairnessPolicy, candidate: SampleJob, enqueued: Sequence[SampleJob], willing: Sequence[SampleJob], step: int,
    page_size: int,
) -> SampleJob | None:
    """The job in the generator that gives its place to `candidate` (see backend.common.fairness), as the
    llama.cpp scheduler chooses: at its caller's limit one of its own (a less urgent one); else the
    policy's pick among those that have run a time slice, or any less urgent one. `willing`: the enqueued
    jobs that may give way (`may_give_way`), found once for every candidate of a pass."""
    return policy.displaced(candidate, enqueued, willing, lambda entry: step - entry.admitted_step,
                            lambda entry: comeback_cost(entry, page_size))


def continuation(victim: SampleJob, make_job: JobFactory, page_size: int) -> Any:
    """The job that continues the victim (whose own job is cancelled); one the generator had not
    started yet simply starts again. Its results keep what only the old job counted."""
    old = victim.job
    if not victim.started:
        return make_job(victim.request, None, None)[0]  # never a constrained one (see above)
    job = make_job(victim.request, Resume(tuple(victim.results.token_ids), old), None)[0]
    # Both generations count these on the job as it runs, and report them only in its EOS result.
    accepted = old.accepted_draft_tokens
    victim.results.preempted(old.cached_pages * page_size + old.cached_tokens, accepted + old.rejected_draft_tokens,
                             accepted)
    return job


def why(victim: SampleJob, newcomer: SampleJob) -> str:
    """Why the victim gave its place to the newcomer, for the log."""
    ours, theirs = victim.request.scheduling.priority, newcomer.request.scheduling.priority
    return f"priority {ours} < {theirs}" if ours < theirs else f"caller {caller_of(victim)!r} over its share"


def continue_with(new_job: Any, previous: Any) -> Any:
    """The new job, sampling on from the old one's random generator (`rng`, a random.Random drawn once
    per token in both generations: 0.3.2 dynamic.py:1740, 1892; 1.6.5 job.py Job.receive_logits)."""
    new_job.rng = previous.rng
    return new_job
