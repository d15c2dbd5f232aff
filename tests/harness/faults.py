"""Faults injected from outside the engine, for tests of what the service does when the engine fails.

`python -m tests.harness.faults [--fail-requests-with-prefix P] [--kill-engine-after-steps N] serve ...` runs
the real server (`tokenspout serve ...`) on an engine built as usual and then wrapped (in the engine's
process, where the engine is made: `FaultRecipe`): nothing in the engine, its config or the CLI knows
about these faults. With `--fake-engine` (and its own `--hold-requests-with-prefix P`, `--step-s S` and
`--step-cpu-s S`), the engine is tests/harness/fake_engine.py's instead.

`--step-gate FILE` lets a test decide how far the engine runs (StepGate is the test's side): a test that
counts engine steps then gets the same steps however loaded the machine is, since the engine waits for
the test instead of running ahead while the test waits for a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import pathlib
import re
import sys
import time

from backend import worker
from backend.config import EngineConfig
from backend.engine import Engine, EventSink, Vocabulary
from backend.events import Event, TokenEvent
from backend.local_engine import WorkerEngine
from backend.registry import MODEL_RECIPE, build_engine
from backend.types import GenerationRequest, ModelInfo
from service import cli
from tests.harness.fake_engine import FakeEngine, FakeVocabulary


def failing_requests(engine: Engine, prefix: str) -> None:
    """Sampling raises for requests whose id starts with `prefix`, as a fault inside one sequence would."""
    if isinstance(engine, FakeEngine):  # its script fails them where sampling would
        engine.plan(prefix, fail_after=0, message=f"injected fault (requests starting with {prefix!r})")
        return
    picker = engine.core.picker
    pick = picker.pick

    def faulty_pick(ctx, row, slot, sampler, output):
        if output.request.request_id.startswith(prefix):
            raise RuntimeError(f"injected fault (requests starting with {prefix!r})")
        return pick(ctx, row, slot, sampler, output)

    picker.pick = faulty_pick


def dying_after(engine: Engine, steps: int) -> None:
    """The engine thread dies after `steps` steps, as a bug in its loop would."""
    core = engine.core
    step = core.step
    count = itertools.count(1)

    def dying_step():
        if next(count) > steps:
            raise RuntimeError(f"injected fault: the engine thread dies after {steps} steps")
        return step()

    core.step = dying_step


FIRST_TOKEN_LINE = "step gate: the first token of {request_id} came at engine step {step}"


class StepGate:
    """The test's side of `--step-gate FILE`: the engine starts no step past the one the file names (commands
    such as add and cancel still apply at once, so admission, refusals and shedding happen while it waits),
    and, once frozen, it checks no time limit either (queue timeouts, deadlines, max_pause_s) while it waits.
    Each write replaces the file whole, so the engine never reads half a limit; the engine answers in
    FILE.at with the step it waits at, once that step's events are delivered."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.limit: int | None = None

    def hold_at(self, step: int) -> None:
        """The engine stops once it has run `step` steps (at once if it has run them already)."""
        self._write(f"{step}")
        self.limit = step

    def freeze_at(self, step: int) -> None:
        """As hold_at, and no time limit is checked while it waits: nothing in the engine changes but by command."""
        self._write(f"{step} frozen")
        self.limit = step

    def run_to(self, step: int, timeout_s: float = 120) -> None:
        """Lets the engine run to `step` and waits until it waits there (it must have work all the way)."""
        self.hold_at(step)
        deadline = time.monotonic() + timeout_s  # a safety net: the engine steps as fast as it can
        while (at := self.waits_at()) is None or at < step:
            assert time.monotonic() < deadline, f"the engine never reached step {step} (it waits at {at})"
            time.sleep(0.005)

    def waits_at(self) -> int | None:
        """The step the engine last stopped at for the gate (None before it first did)."""
        try:
            return int(self.path.with_suffix(".at").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def open(self) -> None:
        """The engine runs freely again."""
        self._write("")
        self.limit = None

    def _write(self, text: str) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(text)
        os.replace(partial, self.path)


def first_token_step(log: str, request_id: str) -> int | None:
    """The engine step that made a request's first token, as a server with --step-gate logs it."""
    line = re.escape(FIRST_TOKEN_LINE.format(request_id=request_id, step="STEP")).replace("STEP", r"(\d+)")
    steps = re.findall(line, log)
    return int(steps[-1]) if steps else None  # the latest request of that id


def gated(engine: Engine, gate: pathlib.Path) -> None:
    """The engine steps only while its step count is below the number in `gate` (no file, or nothing in it: no
    limit); with "frozen" after the number, it skips its time-limit checks while it waits as well. Each request's
    first token is logged with its step (first_token_step)."""
    core, answer = engine.core, gate.with_suffix(".at")
    worker._PAUSED_CHECK_S = 0.005  # a held engine notices a new limit within this (it waits on its commands)
    answered = -1

    def limit() -> tuple[int | None, bool]:
        try:
            words = gate.read_text().split()
        except FileNotFoundError:
            return None, False
        return (int(words[0]), "frozen" in words) if words else (None, False)

    has_work, expire = core.has_work, core.expire

    def has_work_below_the_gate() -> bool:
        nonlocal answered
        most, _ = limit()
        steps = core.stats.steps
        if most is not None and steps >= most:
            if answered != steps:  # called after the last step's events went out: the test may look now
                answered = steps
                partial = answer.with_suffix(".answer")
                partial.write_text(f"{steps}")
                os.replace(partial, answer)
            return False
        return has_work()

    def expire_unless_frozen() -> list:
        _, frozen = limit()
        return [] if frozen else expire()

    core.has_work, core.expire = has_work_below_the_gate, expire_unless_frozen  # type: ignore[method-assign]
    submit = engine.submit

    def submit_noting_the_first_token(request: GenerationRequest, sink: EventSink) -> None:
        noted = False

        def noting(event: Event) -> None:
            nonlocal noted
            if not noted and isinstance(event, TokenEvent) and event.tokens:
                noted = True
                print(FIRST_TOKEN_LINE.format(request_id=request.request_id, step=event.step), file=sys.stderr, flush=True)
            sink(event)

        submit(request, noting)

    engine.submit = submit_noting_the_first_token  # type: ignore[method-assign]


@dataclasses.dataclass(frozen=True)
class FaultRecipe:
    """backend.registry.EngineRecipe: the engine (or the fake one) with these faults (picklable, as processes are
    started with it)."""

    faults: argparse.Namespace

    def engine(self, config: EngineConfig) -> WorkerEngine:
        faults = self.faults
        engine = FakeEngine(config, faults.step_s, faults.step_cpu_s) if faults.fake_engine else build_engine(config)
        if faults.fail_requests_with_prefix:
            failing_requests(engine, faults.fail_requests_with_prefix)
        if faults.hold_requests_with_prefix:
            engine.plan(faults.hold_requests_with_prefix, hold_after=1)
        if faults.kill_engine_after_steps:
            dying_after(engine, faults.kill_engine_after_steps)
        if faults.step_gate:
            gated(engine, faults.step_gate)
        return engine

    def vocabulary(self, config: EngineConfig, info: ModelInfo) -> Vocabulary:
        return FakeVocabulary() if self.faults.fake_engine else MODEL_RECIPE.vocabulary(config, info)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="faults.py")
    parser.add_argument("--fail-requests-with-prefix", default="")
    parser.add_argument("--kill-engine-after-steps", type=int, default=0)
    parser.add_argument("--fake-engine", action="store_true", help="tests/harness/fake_engine.py's engine, not the model")
    parser.add_argument("--hold-requests-with-prefix", default="", help="fake engine: after one token, until cancelled")
    parser.add_argument("--step-s", type=float, default=0.0, help="fake engine: seconds per step (a model's pace)")
    parser.add_argument("--step-cpu-s", type=float, default=0.0,
                        help="fake engine: seconds of Python holding the GIL each step, before --step-s")
    parser.add_argument("--step-gate", type=pathlib.Path, help="a file naming the last step the engine may run (StepGate)")
    faults, serve = parser.parse_known_args(argv)
    if (faults.hold_requests_with_prefix or faults.step_s or faults.step_cpu_s) and not faults.fake_engine:
        parser.error("--hold-requests-with-prefix, --step-s and --step-cpu-s script the fake engine (--fake-engine)")
    return cli.main(serve, recipe=FaultRecipe(faults))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
