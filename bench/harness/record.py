"""What a benchmark declares, and the record of its latest run.

A benchmark is a module of bench/suite/ with a `BENCHMARK` (its area of docs/benchmarks.md, what it needs,
its smoke flags), an `arguments(parser)` and a `measure(run, args)` that puts its figures on `run` as
tables, targets and plot series. `python -m bench NAME` writes the run to bench/results/NAME.json with
the machine, the versions and the command that gave it; `python -m bench report` renders every result
into docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import pathlib
import platform
import subprocess

import msgspec

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

Cell = str | int | float | None


class Benchmark(msgspec.Struct, frozen=True):
    area: str
    """The section of docs/benchmarks.md it belongs to (bench.report.areas.AREAS)."""
    needs: tuple[str, ...] = ()
    """What it starts besides tokenspout: "llama-server" (the reference, `--llama-server PATH`)."""
    smoke: tuple[str, ...] = ()
    """Flags that make it a run of seconds: tests/bench/test_smoke.py runs every benchmark with them."""
    order: int = 0
    """Its place within the area."""


class Table(msgspec.Struct):
    title: str
    columns: list[str]
    rows: list[list[Cell]]


class Target(msgspec.Struct):
    what: str
    value: float
    op: str
    """">=" or "<=": the figure meets the target when `value op bound`."""
    bound: float

    @property
    def met(self) -> bool:
        return self.value >= self.bound if self.op == ">=" else self.value <= self.bound


class Series(msgspec.Struct):
    label: str
    x: list[float]
    y: list[float]


class Plot(msgspec.Struct):
    """A curve that says more than a table: rendered to docs/benchmarks/NAME-N.png by the report."""

    title: str
    x_label: str
    y_label: str
    series: list[Series]
    log_x: bool = False


class Machine(msgspec.Struct):
    cpu: str
    cores: int
    memory_gib: float
    load_at_start: float
    """The 1-minute load average when the run began: these machines are shared."""
    python: str
    gpu: str = ""

    @classmethod
    def here(cls) -> Machine:
        cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")), "")
        memory_kib = next((int(line.split()[1]) for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
        return cls(cpu or platform.processor(), os.cpu_count() or 0, round(memory_kib / 2**20, 1),
                   os.getloadavg()[0], platform.python_version())


class Result(msgspec.Struct):
    benchmark: str
    area: str
    order: int
    command: str
    """How to run it again, from the repository root."""
    date: str
    commit: str
    machine: Machine
    versions: dict[str, str]
    tables: list[Table] = []
    targets: list[Target] = []
    plots: list[Plot] = []
    notes: list[str] = []
    """What the figures say, written by whoever recorded the run (`--note`, or by hand in the JSON)."""
    title: str = ""
    method: str = ""
    """A result whose run is not a module of bench/suite/ (bench/gpu/'s) says what it is; a module's docstring
    says it for the module's results."""
    source: str = ""
    """Where the figures come from when not from this JSON's own run: a run recorded before the suite
    existed, transcribed (say which)."""


class Run:
    """The figures of one run as a benchmark puts them: printed as they come, saved at the end."""

    def __init__(self, name: str, declared: Benchmark, command: str, smoke: bool = False) -> None:
        self.smoke = smoke
        today = datetime.datetime.now(datetime.UTC).date().isoformat()
        self.result = Result(name, declared.area, declared.order, command, today, _commit(), Machine.here(), _versions())

    def table(self, title: str, columns: list[str], rows: list[list[Cell]]) -> None:
        self.result.tables.append(Table(title, columns, rows))
        print(f"\n{title}\n" + "\n".join(markdown_table(Table(title, columns, rows))), flush=True)

    def target(self, what: str, value: float, op: str, bound: float) -> Target:
        assert op in (">=", "<="), op
        target = Target(what, round(value, 4), op, bound)
        self.result.targets.append(target)
        print(f"target: {what} = {value:.3f} ({op} {bound:g}: {'met' if target.met else 'missed'})", flush=True)
        return target

    def plot(self, title: str, x_label: str, y_label: str, series: dict[str, list[tuple[float, float]]],
             log_x: bool = False) -> None:
        self.result.plots.append(Plot(title, x_label, y_label, [
            Series(label, [float(x) for x, _ in points], [float(y) for _, y in points]) for label, points in series.items()
        ], log_x))

    def note(self, text: str) -> None:
        self.result.notes.append(text)

    def save(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.format(msgspec.json.encode(self.result), indent=1) + b"\n")


def load(path: pathlib.Path) -> Result:
    return msgspec.json.decode(path.read_bytes(), type=Result)


def markdown_table(table: Table) -> list[str]:
    return [
        "| " + " | ".join(table.columns) + " |",
        "|" + "---|" * len(table.columns),
        *("| " + " | ".join(_cell(value) for value in row) + " |" for row in table.rows),
    ]


def _cell(value: Cell) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        # Ratios keep three decimals (1.005 is not 1), rates one, large counts none; tiny values their figures.
        if abs(value) < 0.01:
            return f"{value:.3g}"
        if abs(value) < 10:
            return f"{value:.3f}".rstrip("0").rstrip(".")
        return f"{value:.1f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _lines(path: str) -> list[str]:
    try:
        return pathlib.Path(path).read_text().splitlines()
    except OSError:
        return []


def _commit() -> str:
    """The checkout's commit, marked when it has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "") if commit else "unknown"


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("llama-cpp-python", "grpcio", "llguidance", "protobuf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
