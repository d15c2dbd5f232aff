"""Which of llama-server's speculation settings is its best on the speculation workloads.
llama-server plain and once per setting, each sent the same chat prompts (bench.harness.workloads), new to it, in turn;
decode tok/s over plain's, median over the prompts, and the geometric mean over the workloads. The winner is what the
speculation benchmark runs as llama-server's best.
"""

from __future__ import annotations

import argparse
import math
import statistics

from backend import ChatMessage, EngineConfig, build_engine
from bench.harness.llama_server import LlamaServer
from bench.harness.pairing import rotated
from bench.harness.record import Benchmark, Run
from bench.harness.sides import CONTEXT, THREADS, Sides
from bench.harness.workloads import WORKLOADS

BENCHMARK = Benchmark(
    area="Speculative decoding",
    needs=("llama-server",),
    smoke=("--workloads", "copy", "--candidates", "ngram-simple 3/8", "--prompts", "1", "--tokens", "16"),
    order=9,
)
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


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="copy,edit,quote", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="settings to try, comma-separated")
    parser.add_argument("--prompts", type=int, default=5, help="prompts of each workload")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--tokens", type=int, default=120)


def chat_prompts(workloads: list[str], count: int) -> dict[str, list[list[int]]]:
    """Each workload's texts as the model's chat template renders them."""
    engine = build_engine(EngineConfig.of(context_length=CONTEXT, max_batch_size=1))
    try:
        return {name: [engine.render_chat([ChatMessage("user", text)]) for text in WORKLOADS[name][:count]]
                for name in workloads}
    finally:
        engine.close()


def decode_rate(server: LlamaServer, prompt: list[int], tokens: int) -> float:
    done = server.stream(prompt, tokens)
    return done.tokens / (done.total_s - done.ttft_s)


def measure(run: Run, args: argparse.Namespace) -> None:
    workloads, candidates = args.workloads.split(","), args.candidates.split(",")
    prompts = chat_prompts(workloads, args.prompts)
    settings = {"plain": "", **{name: CANDIDATES[name] for name in candidates}}
    ratios: dict[str, dict[str, float]] = {name: {} for name in candidates}
    with Sides() as sides:
        servers = {name: sides.llama_server(args.llama_server, *flags.split(), threads=args.threads)
                   for name, flags in settings.items()}
        for workload in workloads:
            per_prompt: dict[str, list[float]] = {name: [] for name in candidates}
            for turn, prompt in enumerate(prompts[workload]):
                rates = {name: decode_rate(servers[name], prompt, args.tokens) for name in rotated(list(servers), turn)}
                for name in candidates:
                    per_prompt[name].append(rates[name] / rates["plain"])
            for name in candidates:
                ratios[name][workload] = statistics.median(per_prompt[name])
    overall = {name: math.exp(statistics.fmean(math.log(r) for r in by.values())) for name, by in ratios.items()}
    rows = [[name, *(round(ratios[name][w], 2) for w in workloads), round(overall[name], 2)]
            for name in sorted(candidates, key=lambda name: -overall[name])]
    run.table("", ["setting: decode tok/s / plain", *workloads, "geometric mean"], rows)
    best = rows[0][0]
    run.note(f"Best: `{settings[best]}` ({overall[best]:.2f}x plain).")
