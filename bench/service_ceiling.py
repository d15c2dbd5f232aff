"""How many streams the service keeps up with when the engine costs nothing: tokenspout on the fake
engine paced as a GPU (one batch step per `--step-s`, 20 ms), against bench.minimal_server (the same
step loop and messages behind a bare grpc.aio server), with the same client, in one run.

For each stream count, alternating the two servers (each going first in every other rep), one
bench.ceiling_client process opens N greedy streams of `--tokens` tokens and reports:
  - tokens/s while all N streamed, as a fraction of the ideal N / step_s ("steady"), and over the whole
    run, from the first request sent to the last message ("whole run": the streams' start counts too)
  - server CPU per token (every thread of the server process, from /proc), in microseconds
  - p99 gap between one stream's consecutive messages, in milliseconds
  - the client's own CPU per token (it shares the machine's cores with the server)
and prints each figure's range over the reps.

    python -m bench.service_ceiling [--streams 1,32,128,256,512] [--tokens 200] [--reps 3] [--step-s 0.02]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import cpu_seconds
from tests.harness.servers import ROOT, start_server, stop_server

SIDES = ("tokenspout", "minimal")


def start_minimal(step_s: float) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "bench.minimal_server", "--step-s", str(step_s)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("minimal server on "):
        process.kill()
        raise RuntimeError(f"the minimal server did not start: {line!r}")
    return process, line.split()[-1]


def measure(address: str, pid: int, streams: int, tokens: int, step_s: float) -> dict:
    """One client run against one server: the client's figures with the server's CPU and the ideal added."""
    before = cpu_seconds(pid)
    done = subprocess.run([sys.executable, "-m", "bench.ceiling_client", address, "--streams", str(streams),
                           "--tokens", str(tokens)], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    result["server_cpu_s"] = cpu_seconds(pid) - before
    # Under a second with all N streaming (they started late), the steady rate means nothing: none.
    steady = result["steady_window_s"] >= 1.0
    result["of_ideal"] = result["steady_tokens_per_s"] / (streams / step_s) if steady else None
    result["whole_of_ideal"] = result["whole_tokens_per_s"] / (streams / step_s)
    return result


def span(measured: list[float | None], scale: float = 1.0, digits: int = 2) -> str:
    values = [value for value in measured if value is not None]
    if not values:
        return "none"
    low, high = min(values) * scale, max(values) * scale
    return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:.{digits}f}-{high:.{digits}f}"


def report(streams: int, runs: dict[str, list[dict]]) -> str:
    cells = [str(streams)]
    for side in SIDES:
        cells.append(span([r["of_ideal"] for r in runs[side]]))
    for side in SIDES:
        cells.append(span([r["whole_of_ideal"] for r in runs[side]]))
    for side in SIDES:
        cells.append(span([r["server_cpu_s"] / r["tokens"] for r in runs[side]], 1e6, 0))
    pairs = zip(runs["tokenspout"], runs["minimal"])
    ratios = [t["server_cpu_s"] / m["server_cpu_s"] for t, m in pairs if m["server_cpu_s"]]
    # The median too: one rep in four or five lands far off (see docs/benchmarks.md, the scheduler's part).
    cells.append(f"{span(ratios)} (median {statistics.median(ratios):.2f})" if ratios else "none")
    for side in SIDES:
        cells.append(span([r["p99_gap_s"] for r in runs[side]], 1e3, 0))
    cells.append(span([r["client_cpu_s"] / r["tokens"] for side in SIDES for r in runs[side]], 1e6, 0))
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| streams | steady of ideal, tokenspout | minimal | whole run of ideal, tokenspout | minimal "
    "| server CPU/token us, tokenspout | minimal | CPU ratio | p99 gap ms, tokenspout | minimal "
    "| client CPU/token us |\n|" + "---|" * 11
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.service_ceiling")
    parser.add_argument("--streams", default="1,32,128,256,512")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--serve-flag", action="append", default=[], help="an extra flag for tokenspout serve")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    most = max(counts)
    flags = ("--max-batch-size", str(most), "--max-queued-requests", str(most), *args.serve_flag)
    with tempfile.TemporaryDirectory() as tmp:
        tokenspout = start_server(pathlib.Path(tmp), *flags, faults=("--step-s", str(args.step_s)), fake_engine=True)
        minimal, minimal_address = start_minimal(args.step_s)
        servers = {"tokenspout": (tokenspout.address, tokenspout.process.pid),
                   "minimal": (minimal_address, minimal.pid)}
        try:
            for side in SIDES:  # warm both: first calls, channels, the fake engine's tokenizer
                measure(*servers[side], 8, 20, args.step_s)
            print(HEADER, flush=True)
            for streams in counts:
                runs: dict[str, list[dict]] = {side: [] for side in SIDES}
                for rep in range(args.reps):
                    for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                        runs[side].append(measure(*servers[side], streams, args.tokens, args.step_s))
                        time.sleep(0.5)  # the last streams' ends settle before the next run
                print(report(streams, runs), flush=True)
                for side in SIDES:
                    rounded = [{k: v if v is None else round(v, 4) for k, v in r.items()} for r in runs[side]]
                    print(f"#   {side}: " + json.dumps(rounded), file=sys.stderr, flush=True)
        finally:
            stop_server(tokenspout)
            minimal.terminate()
            minimal.wait(timeout=30)


if __name__ == "__main__":
    main()
