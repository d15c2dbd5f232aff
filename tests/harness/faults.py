"""Faults injected from outside the engine, for tests of what the service does when the engine fails.

`python -m tests.harness.faults [--fail-requests-with-prefix P] [--kill-engine-after-steps N] serve ...` runs
the real server (`tokenspout serve ...`) on an engine built as usual and then wrapped: nothing in the
engine, its config or the CLI knows about these faults. With `--fake-engine` (and its own
`--hold-requests-with-prefix P` and `--step-s S`), the engine is tests/harness/fake_engine.py's instead.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from backend.config import EngineConfig
from backend.engine import Engine
from backend.registry import build_engine
from tests.harness.fake_engine import FakeEngine
from service import cli


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="faults.py")
    parser.add_argument("--fail-requests-with-prefix", default="")
    parser.add_argument("--kill-engine-after-steps", type=int, default=0)
    parser.add_argument("--fake-engine", action="store_true", help="tests/harness/fake_engine.py's engine, not the model")
    parser.add_argument("--hold-requests-with-prefix", default="", help="fake engine: after one token, until cancelled")
    parser.add_argument("--step-s", type=float, default=0.0, help="fake engine: seconds per step (a model's pace)")
    faults, serve = parser.parse_known_args(argv)
    if (faults.hold_requests_with_prefix or faults.step_s) and not faults.fake_engine:
        parser.error("--hold-requests-with-prefix and --step-s script the fake engine (--fake-engine)")

    def build(config: EngineConfig) -> Engine:
        engine = FakeEngine(config, faults.step_s) if faults.fake_engine else build_engine(config)
        if faults.fail_requests_with_prefix:
            failing_requests(engine, faults.fail_requests_with_prefix)
        if faults.hold_requests_with_prefix:
            engine.plan(faults.hold_requests_with_prefix, hold_after=1)
        if faults.kill_engine_after_steps:
            dying_after(engine, faults.kill_engine_after_steps)
        return engine

    return cli.main(serve, build=build)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
