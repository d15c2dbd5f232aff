"""The benchmark suite.

    python -m bench                     the benchmarks, by area
    python -m bench NAME [flags]        run one; its figures go to bench/results/NAME.json
    python -m bench NAME --smoke        a run of seconds with the benchmark's smoke flags (tests/bench/test_smoke.py)
    python -m bench report [--check]    docs/benchmarks.md and its plots from bench/results/
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import subprocess
import sys

from bench import suite
from bench.harness.record import RESULTS, ROOT, Run


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        return listing()
    if argv[0] == "report":
        from bench.report.render import main as report

        return report(argv[1:])
    return run(argv[0], argv[1:])


def listing() -> int:
    print(__doc__.strip() + "\n")
    by_area: dict[str, list[str]] = {}
    for name in suite.names():
        by_area.setdefault(suite.load(name).BENCHMARK.area, []).append(name)
    for area, names in by_area.items():
        print(f"{area}:")
        for name in names:
            print(f"  {name:22} {(suite.load(name).__doc__ or '').strip().splitlines()[0]}")
    return 0


def run(name: str, argv: list[str]) -> int:
    module = suite.load(name)
    declared = module.BENCHMARK
    parser = argparse.ArgumentParser(prog=f"python -m bench {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a run of seconds, with the benchmark's smoke flags; "
                        "written to --out only")
    parser.add_argument("--out", type=pathlib.Path,
                        help=f"where to write the result (default {RESULTS.relative_to(ROOT)}/{name}.json)")
    parser.add_argument("--note", action="append", default=[], help="what the figures say, kept with them (repeatable)")
    if "llama-server" in declared.needs:
        parser.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server, the reference "
                            "(default: $TOKENSPOUT_LLAMA_SERVER, else `make -s llama-server` builds it once)")
    module.arguments(parser)
    smoke = "--smoke" in argv
    args = parser.parse_args([*declared.smoke, *argv] if smoke else argv)
    if "llama-server" in declared.needs and not args.llama_server:
        args.llama_server = llama_server()
    recorded = _without([arg for arg in argv if arg != "--smoke"], "--llama-server", "--out", "--note")
    record = Run(name, declared, shlex.join(["python", "-m", "bench", name, *recorded]), smoke)
    module.measure(record, args)
    for note in args.note:
        record.note(note)
    out = args.out or (None if smoke else RESULTS / f"{name}.json")
    if out is not None:
        record.save(out)
        print(f"\nwritten to {out}")
    return 0


def llama_server() -> str:
    """The reference's binary: the one named in the environment, else the Makefile's (built on first use)."""
    if path := os.environ.get("TOKENSPOUT_LLAMA_SERVER"):
        return path
    built = subprocess.run(["make", "-s", "llama-server"], cwd=ROOT, capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"`make llama-server` failed:\n{built.stderr}")
    return built.stdout.strip().splitlines()[-1]


def _without(argv: list[str], *flags: str) -> list[str]:
    """`argv` less `flags` and their values (`--flag value` or `--flag=value`)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in flags)):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
