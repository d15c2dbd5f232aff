"""Recompute preemption for exllamav2: who may give way, who does, and the job that continues it.

The generator cannot pause a job, so a job gives its batch place by being cancelled (its pages go
back to the generator, keeping their keys and values), and comes back later as a new job whose
prompt is the old one's prompt and output. exllamav2 finds full pages again by the hash of the
tokens they hold, and copies a partial last page from the best match, so while the cache has not
reused them the comeback computes little (unpaged, a page is the whole cache: it computes everything
again, which the fairness policy weighs as the cost of bringing it back). The caller's stream goes on where it was: no token is
repeated or dropped, because a job gives way only at a clean boundary:

- nothing held: no text or token held back for a partial stop string, a partial banned string
  (no checkpoint) or an incomplete UTF-8 character. Everything the job sampled has then reached
  the caller, so the new job's input is exactly the old job's sequence, and the new job's empty
  hold buffer is the old one's;
- no constraint. The grammar matcher would have to go on in the new job, but exllamav2 keeps a
  cancelled job's filter queued for a background mask on its filter threads (generator.filter_queue),
  so the old job would still touch the matcher while the new one uses it. Constrained jobs hold
  their place until they end (a more urgent request takes the next free one).

The new job also carries the old one's random generator (a seeded request samples the same
sequence either way) and sampler settings (mirostat's state), heals no token, and counts
max_new_tokens and min_new_tokens from the output so far (backend.exllamav2.jobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend.common.fairness import FairnessPolicy, caller_of
from backend.exllamav2.held import HeldJob, JobFactory, Resume


def holds_nothing(job: Any) -> bool:
    """Whether an exllamav2 0.3.2 job holds no text, no tokens and no banned-string checkpoint
    (ExLlamaV2DynamicJob.held_text, held_tokens, checkpoint: dynamic.py:1560-1593)."""
    return not job.held_text and not len(job.held_tokens) and job.checkpoint is None


def may_give_way(entry: HeldJob) -> bool:
    return entry.request.constraint is None and holds_nothing(entry.job)


def comeback_cost(entry: HeldJob, page_size: int) -> int:
    """The tokens its comeback computes again while its pages stay cached: those past its last full page."""
    return len(entry.tokens) % page_size


def victim_for(
    policy: FairnessPolicy, candidate: HeldJob, enqueued: Sequence[HeldJob], willing: Sequence[HeldJob], step: int,
    page_size: int,
) -> HeldJob | None:
    """The job in the generator that gives its place to `candidate` (see backend.common.fairness), as the
    llama.cpp scheduler chooses: at its caller's limit one of its own (a less urgent one); else the
    policy's pick among those that have run a time slice, or any less urgent one. `willing`: the enqueued
    jobs that may give way (`may_give_way`), found once for every candidate of a pass."""
    return policy.displaced(candidate, enqueued, willing, lambda entry: step - entry.admitted_step,
                            lambda entry: comeback_cost(entry, page_size))


def continuation(victim: HeldJob, make_job: JobFactory, page_size: int) -> Any:
    """The job that continues the victim (whose own job is cancelled); one the generator had not
    started yet simply starts again. Its results keep what only the old job counted."""
    old = victim.job
    if victim.results.started_at is None:
        return make_job(victim.request, None, None)[0]  # never a constrained one (see above)
    job = make_job(victim.request, Resume(tuple(victim.results.token_ids), old), None)[0]
    accepted = getattr(old, "accepted_draft_tokens", 0)  # 0.3.2 reports them only at the job's end
    victim.results.preempted(getattr(old, "cached_pages", 0) * page_size + getattr(old, "cached_tokens", 0),
                             accepted + getattr(old, "rejected_draft_tokens", 0), accepted)
    return job


def why(victim: HeldJob, newcomer: HeldJob) -> str:
    """Why the victim gave its place to the newcomer, for the log."""
    ours, theirs = victim.request.scheduling.priority, newcomer.request.scheduling.priority
    return f"priority {ours} < {theirs}" if ours < theirs else f"caller {caller_of(victim)!r} over its share"


def continue_with(new_job: Any, previous: Any) -> Any:
    """The new job, sampling on from the old one's random generator (ExLlamaV2DynamicJob.rng,
    a random.Random drawn once per token: dynamic.py:1740, 1892)."""
    new_job.rng = previous.rng
    return new_job
