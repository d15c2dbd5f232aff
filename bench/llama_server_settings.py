"""Which of llama-server's speculation settings is its best on bench/speculation.py's workloads.

Starts llama-server plain and once per candidate setting (same GGUF, slots and threads as
bench/speculation.py), sends every server the same prompts in turn, each prompt new to every server
(so a pool kept across requests has not seen it), and prints each setting's decode tok/s over plain's,
the median over the prompts, per workload and as the geometric mean over them. The winner is what
bench/speculation.py runs as BEST_SPEC.

    python -m bench.llama_server_settings --llama-server PATH [--workloads copy,edit,quote]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys

from backend.common.models import default_model_path
from backend.llamacpp.model import GgufModel, init_backend
from backend.types import ChatMessage
from bench.llama_server import start_llama_server
from bench.speculation import CONTEXT, SLOTS
from bench.workloads import WORKLOADS

ROOT = pathlib.Path(__file__).resolve().parent.parent

CANDIDATES = {
    "ngram-mod 4/2/16": "--spec-type ngram-mod --spec-ngram-mod-n-match 4 --spec-ngram-mod-n-min 2 --spec-ngram-mod-n-max 16",
    "ngram-mod 4/1/8": "--spec-type ngram-mod --spec-ngram-mod-n-match 4 --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 8",
    "ngram-mod 8/2/16": "--spec-type ngram-mod --spec-ngram-mod-n-match 8 --spec-ngram-mod-n-min 2 --spec-ngram-mod-n-max 16",
    "ngram-simple 4/16": "--spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 16",
    "ngram-simple 3/8": "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8",
    "ngram-simple 3/16": "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16",
    "ngram-simple 2/8": "--spec-type ngram-simple --spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 8",
    "ngram-map-k 4/16": "--spec-type ngram-map-k --spec-ngram-map-k-size-n 4 --spec-ngram-map-k-size-m 16",
    "ngram-cache": "--spec-type ngram-cache",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--workloads", default="copy,edit,quote")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=120)
    args = parser.parse_args()

    init_backend()
    model = GgufModel(default_model_path())
    settings = {"plain": "", **CANDIDATES}
    servers = {name: start_llama_server(args.llama_server, default_model_path(), CONTEXT, SLOTS, args.threads, flags.split())
               for name, flags in settings.items()}
    try:
        ratios: dict[str, dict[str, float]] = {name: {} for name in CANDIDATES}
        for workload in args.workloads.split(","):
            per_prompt: dict[str, list[float]] = {name: [] for name in CANDIDATES}
            for text in WORKLOADS[workload]:
                prompt = model.render_chat([ChatMessage("user", text)])
                rates = {}
                for name, server in servers.items():
                    done = server.stream(prompt, args.tokens)
                    rates[name] = done.tokens / (done.total_s - done.ttft_s)
                for name in CANDIDATES:
                    per_prompt[name].append(rates[name] / rates["plain"])
            for name in CANDIDATES:
                ratios[name][workload] = statistics.median(per_prompt[name])
            print(f"{workload:6} " + "  ".join(f"{name} {ratios[name][workload]:.2f}" for name in CANDIDATES), flush=True)
        overall = {name: math.exp(statistics.fmean(math.log(r) for r in by.values())) for name, by in ratios.items()}
        for name, ratio in sorted(overall.items(), key=lambda item: -item[1]):
            print(f"{ratio:.2f}x plain (geometric mean): {name}  ({settings[name]})")
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
