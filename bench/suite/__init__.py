"""The benchmarks, one module each: a `BENCHMARK` declaration (bench.harness.record.Benchmark), `arguments(parser)`
and `measure(run, args)`. `python -m bench` lists them."""

from __future__ import annotations

import importlib
import pathlib
from types import ModuleType


def names() -> list[str]:
    return sorted(path.stem for path in pathlib.Path(__file__).parent.glob("*.py") if path.stem != "__init__")


def load(name: str) -> ModuleType:
    if name not in names():
        raise SystemExit(f"no benchmark {name!r}: `python -m bench` lists them")
    return importlib.import_module(f"bench.suite.{name}")
