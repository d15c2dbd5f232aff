"""Drives an engine core in-process the way backend.worker does (every command and step is settled and its
outputs delivered), and records what each request receives: the helpers the step-by-step core tests share."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from backend.common.stats import CancelOrder
from backend.events import ErrorEvent, TokenEvent
from backend.types import GenerationRequest, SamplingParams, StopParams
from backend.worker import deliver_all

_COMMANDS = frozenset({"add", "cancel", "pause", "resume", "expire", "step", "close"})


class Delivering:
    """Wraps a core; each of its commands is settled at once and the events delivered to the requests' sinks,
    and returned too."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.core, name)
        if name not in _COMMANDS:
            return attribute

        def command(*args, **kwargs):
            if name == "cancel" and isinstance(args[0], str):  # as the worker issues it, now
                args = (CancelOrder(args[0], time.monotonic(), self.core.steps),)
            model = getattr(self.core, "model", None)  # a llama.cpp core's; the exllamav2 tests pass their own
            if name == "add" and len(args) == 2 and args[0].constraint is not None and model is not None:
                args = (*args, compiler_for(model).compile(args[0].constraint))  # compiled, as the engine does
            attribute(*args, **kwargs)
            outputs = self.core.settle()
            deliver_all(outputs)
            return outputs

        return command


@functools.cache
def compiler_for(model):
    """One constraint compiler per model (its tokenizer takes a second to build), as its engine has one."""
    from backend.constraints import ConstraintCompiler

    return ConstraintCompiler(model.constraint_tokenizer())


def make_core(model, **settings) -> Delivering:
    """A llama.cpp core on `model`, driven in-process, whose commands deliver their events as the worker does."""
    from backend.common.cores import usable_cores
    from backend.config import EngineConfig
    from backend.llamacpp.core import LlamaCppCore

    # A core test runs alone (the suite is serial): its model work takes every core, up to 4 (a model this
    # small gains nothing beyond). Greedy output does not depend on the count: each row is one thread's.
    config = dict(context_length=256, max_batch_size=2, batch_tokens=64, threads=min(4, usable_cores())) | settings
    return Delivering(LlamaCppCore(model, EngineConfig.of(**config)))


class Recorder:
    """A request's sink: each event with the core step it arrived at."""

    def __init__(self, core) -> None:
        self.core = core
        self.events: list[tuple[int, object]] = []

    def __call__(self, event) -> None:
        self.events.append((self.core.steps, event))

    @property
    def finish(self):
        last = self.events[-1][1]
        return last.finish if isinstance(last, TokenEvent) else None

    def first_token_step(self) -> int:
        return next(step for step, event in self.events if isinstance(event, TokenEvent) and event.tokens)


def token_ids(rec: Recorder) -> list[int]:
    return [t.token_id for _, event in rec.events if not isinstance(event, ErrorEvent) for t in event.tokens]


def request(model, request_id: str, prompt: str = "The sky is", max_new_tokens: int = 8) -> GenerationRequest:
    """A greedy request for `prompt` that runs to max_new_tokens."""
    return GenerationRequest(
        request_id,
        tuple(model.tokenize(prompt)),
        SamplingParams(temperature=0.0),
        StopParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def run_until_idle(core, limit: int = 2000, after_step: Callable[[Any], None] | None = None) -> None:
    """Steps the core until it has no work (calling `after_step(core)` after each step)."""
    for _ in range(limit):
        if not core.has_work():
            return
        core.step()
        if after_step is not None:
            after_step(core)
    raise AssertionError("the core did not finish")
