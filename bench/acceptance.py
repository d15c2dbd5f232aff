"""How often proposals are accepted, by where they came from (backend/llamacpp/speculation/drafts.py's SOURCES),
for each workload of bench/workloads.py: the figures behind the planner's per-source acceptance.

Every prompt runs alone on the engine core in-process, greedy, with the planner made to check every
proposal it is offered (at most --draft tokens), so every source is seen whatever the machine's costs.
Prints, per workload and source: checks, proposed tokens, accepted tokens, and the per-token acceptance
a geometric model gives (accepted / (accepted + checks that stopped short)).

    python -m bench.acceptance [--tokens 120] [--draft 8]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

from backend.common.models import default_model_path
from backend.llamacpp.model import GgufModel
from backend.llamacpp.speculation import speculator as speculator_module
from backend.llamacpp.speculation.drafts import DraftState
from backend.types import ChatMessage, GenerationRequest, SamplingParams, SpeculationMode, SpeculationParams, StopParams
from bench.workloads import WORKLOADS
from tests.harness.core_driver import Recorder, make_core, run_until_idle

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--draft", type=int, default=8)
    args = parser.parse_args()
    model = GgufModel(default_model_path())
    tally: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    workload = [""]
    learn = DraftState.checked

    def counted(self, source: str, proposed: int, accepted: int) -> None:
        row = tally[workload[0], source]
        row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + proposed, row[2] + accepted, row[3] + (accepted < proposed)
        learn(self, source, proposed, accepted)

    DraftState.checked = counted
    speculator_module.plan_drafts = lambda candidates, costs: [min(len(c.proposed), args.draft) for c in candidates]
    for name, prompts in WORKLOADS.items():
        workload[0] = name
        for i, text in enumerate(prompts):
            core = make_core(model, context_length=1024, max_batch_size=1, batch_tokens=512)
            try:
                prompt = tuple(model.render_chat([ChatMessage("user", text)]))
                core.add(GenerationRequest(f"{name}{i}", prompt, SamplingParams(temperature=0.0),
                                           StopParams(max_new_tokens=args.tokens, ignore_eos=True),
                                           speculation=SpeculationParams(SpeculationMode.NGRAM, 16)), Recorder(core))
                run_until_idle(core)
            finally:
                core.close()
    print(f"{args.tokens} greedy tokens a prompt, every proposal checked (at most {args.draft} tokens)")
    for (name, source), (checks, proposed, accepted, stopped) in sorted(tally.items()):
        print(f"{name:<6} {source:<8} checks {checks:4d}  proposed {proposed:5d}  accepted {accepted:5d}  "
              f"per-token acceptance {accepted / max(accepted + stopped, 1):.2f}")
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
