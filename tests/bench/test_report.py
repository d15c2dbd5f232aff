"""docs/benchmarks.md is what `python -m bench report` renders from bench/results/, within its 500 lines, and
every result names a section the page has."""

from __future__ import annotations

import subprocess
import sys

from bench.harness.record import RESULTS, ROOT, Machine, Result, Table, Target
from bench.report.areas import AREAS
from bench.report.render import LIMIT, render, results


def test_the_page_is_what_the_results_render():
    done = subprocess.run([sys.executable, "-m", "bench", "report", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_result_is_in_a_section_and_the_page_keeps_its_limit():
    found = results()
    assert found and {result.area for result in found} <= set(AREAS)
    page, _ = render(found)
    assert page.count("\n") <= LIMIT
    assert len(found) == len(list(RESULTS.glob("*.json")))


def test_a_result_renders_its_command_machine_tables_targets_and_notes():
    result = Result("example", "Streaming overhead", 0, "python -m bench example --reps 3", "2026-12-07", "abc123",
                    Machine("some cpu", 2, 24.0, 1.5, "3.11.9"), {},
                    [Table("rates", ["streams", "ratio"], [[1, 0.98765], [8, None]])],
                    [Target("ratio at 8 streams", 0.9, ">=", 0.97)], notes=["The ratio falls with streams."],
                    title="An example", source="transcribed")
    page, plots = render([result])
    section = " ".join(page.split("## Streaming overhead", 1)[1].split())  # as read, not as wrapped
    # The area's only result: its title in bold opens its paragraph.
    assert section.startswith("**An example.** Run: `python -m bench example --reps 3` (2026-12-07, 2 cores (some cpu), "
                              "load 1.5, `abc123`) †.")
    assert "| 1 | 0.988 | | 8 | - |" in section
    assert "Targets: ratio at 8 streams = 0.9 (>= 0.97, **missed**). The ratio falls with streams." in section
    assert plots == {} and "## Threads" not in page  # an area without results has no section
