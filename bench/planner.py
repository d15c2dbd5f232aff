"""The speculation planner replayed on the real model at fixed decode costs: what the policy alone gives.

bench/speculation.py measures wall-clock rates, which move by 10-30% from run to run on a shared host,
more than most changes to the planner. Here every decode is charged what it was measured to cost on this
machine (bench/decode_costs.py: a line of a pass and a row, and one sequence's decodes of 1 to 17 rows
with logits on each, which sit off the line), and the planner learns costs from those charges as the
engine learns from the clock, starting from the line and the lone row. So a run is deterministic: the
same policy gives the same figures, and a changed constant shows its effect alone. The prompts of each
workload (bench/workloads.py) run one at a time on one engine, in the bench's order, so what the engine
learns of each source and shape carries over as it does in a server.

Prints, per workload and prompt, modelled n-gram tok/s over modelled plain decoding (a lone row a
token), and the median and geometric mean over the prompts; beside them the same for an oracle, a
planner that knows how many tokens of each proposal are right and checks exactly those (the same
proposals, at the same costs): about the most any planner could make of them here.

    python -m bench.planner [--set NAME=VALUE ...] [--tokens 120]

  --set   overrides a constant of backend/llamacpp/speculation/ for the run, e.g. --set _CURIOSITY=0.5
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

from backend.common.models import default_model_path
from backend.config import EngineConfig
from backend.llamacpp.core import LlamaCppCore
from backend.llamacpp.model import GgufModel, init_backend
from backend.llamacpp.speculation import drafts, planner, proposers
from backend.llamacpp.speculation.costs import DecodeCosts
from backend.llamacpp.speculation.drafts import DraftState, proposal
from backend.types import (
    ChatMessage,
    GenerationRequest,
    SamplingParams,
    Scheduling,
    SpeculationMode,
    SpeculationParams,
    StopParams,
)
from bench.workloads import WORKLOADS

ROOT = pathlib.Path(__file__).resolve().parent.parent


LINE = dict(pass_s=0.00665, row_s=0.00331)
ONE_SEQUENCE_MS = (8.02, 13.55, 18.39, 18.91, 24.27, 26.77, 31.64, 32.79, 37.83, 39.01, 43.60, 44.74, 48.33, 51.62,
                   56.25, 60.40, 63.09)
"""Measured here (bench/decode_costs.py, 2026-12-03 evening, docs/benchmarks.md): the line, and one sequence's
decode of 1 to 17 rows with logits on each."""


def measured() -> DecodeCosts:
    return DecodeCosts.given(**LINE, shapes={(1, rows, rows): ms / 1000 for rows, ms in enumerate(ONE_SEQUENCE_MS, 1)})


class ModelledDecodes:
    """Stands in for the speculator's thread tuner: each decode is charged what `truth` says it costs, and
    the planner plans with `planned` (current_costs), which learns from those charges."""

    def __init__(self, truth: DecodeCosts, planned: DecodeCosts, threads: int) -> None:
        self.truth, self.current_costs, self.threads, self.charged = truth, planned, threads, 0.0

    def record(self, passes: int, rows: int, logit_rows: int, seconds: float, prefill: bool = False) -> int:
        if not prefill:
            cost = self.truth.estimate(passes, rows, logit_rows)
            self.charged += cost
            self.current_costs.record(passes, rows, logit_rows, cost)
        return self.threads


def replay(
    core: LlamaCppCore, prompt: tuple[int, ...], tokens: int, name: str, mode: SpeculationMode, planned: DecodeCosts
):
    """(modelled tok/s over plain decoding's, the output) of one greedy request alone; `planned`: the costs
    the planner plans with, learning from each decode's charge."""
    truth, output = measured(), []
    decodes = core.speculator.tuner = ModelledDecodes(truth, planned, core.speculator.threads)
    request = GenerationRequest(
        name, prompt, SamplingParams(temperature=0.0), StopParams(max_new_tokens=tokens, ignore_eos=True),
        speculation=SpeculationParams(mode, 16), scheduling=Scheduling(caller=name),
    )
    sink = lambda event: output.extend(t.token_id for t in getattr(event, "tokens", ()) or ())  # noqa: E731
    core.add(request, sink)
    while core.has_work():
        core.step()
        for deliver, event in core.settle():
            deliver(event)
    return (len(output) - 1) * truth.estimate(1, 1, 1) / decodes.charged, output  # the first token comes from the prompt


def oracle(prompt: tuple[int, ...], output: list[int]) -> float:
    """Modelled tok/s over plain decoding's for a planner that knows how much of each proposal is right:
    it checks exactly that (a pass and a row for each token it gets), or decodes plainly."""
    costs, draft, charged, at = measured(), DraftState(16), 0.0, 1
    while at < len(output):
        offer = proposal([*prompt, *output[:at]], len(prompt), draft, None, min(16, len(output) - at - 1))
        right = 0
        while right < len(offer.tokens) and offer.tokens[right] == output[at + right]:
            right += 1
        charged += costs.estimate(1, right + 1, right + 1)
        at += right + 1
    return (len(output) - 1) * costs.estimate(1, 1, 1) / charged


def summary(ratios: list[float]) -> str:
    return (f"median {statistics.median(ratios):.3f} geomean {statistics.geometric_mean(ratios):.3f} "
            f"({' '.join(f'{r:.2f}' for r in ratios)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--tokens", type=int, default=120)
    args = parser.parse_args()
    for assignment in args.set:
        name, value = assignment.split("=", 1)
        module = next((m for m in (drafts, planner, proposers) if hasattr(m, name)), None)
        if module is None:
            parser.error(f"backend/llamacpp/speculation/ has no {name}")
        setattr(module, name, type(getattr(module, name))(value))
    init_backend()
    model = GgufModel(default_model_path())
    core = LlamaCppCore(model, EngineConfig.of(context_length=1024, max_batch_size=8, batch_tokens=512, threads=2))
    print(f"modelled n-gram / plain, {args.tokens} greedy tokens, {' '.join(args.set) or 'the current policy'}")
    planned = DecodeCosts.given(**LINE, shapes={(1, 1, 1): ONE_SEQUENCE_MS[0] / 1000})  # as learned, carried over
    try:
        for workload, prompts in WORKLOADS.items():
            ours, best = [], []
            for i, text in enumerate(prompts):
                prompt = tuple(model.render_chat([ChatMessage("user", text)]))
                ratio, output = replay(core, prompt, args.tokens, f"{workload}{i}", SpeculationMode.NGRAM, planned)
                ours.append(ratio)
                best.append(oracle(prompt, output))
            print(f"{workload:6} planner {summary(ours)} | oracle {summary(best)}", flush=True)
    finally:
        core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
