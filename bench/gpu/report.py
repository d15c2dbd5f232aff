"""The GPU check's short summary: each stage of run.sh, then each served variant's checks and rates.

    python3 bench/gpu/report.py STAGES.tsv [CHECK.json ...]   # prints summary.txt; exit 1 if anything failed

Standard library only: it must work when nothing else installed (the summary is most needed then).
A stage line in STAGES.tsv is `name<TAB>status<TAB>seconds<TAB>detail`, status one of ok, FAIL,
TIMEOUT or SKIP; a stage skipped for want of time (detail "no time left ...") counts as a failure,
one skipped for want of a GPU or of a stage it needs does not. A variant's JSON may be missing or
cut short (a stage killed at its limit): that is reported as such, never as a crash.
"""

from __future__ import annotations

import json
import pathlib
import sys

BAD_STAGE = ("FAIL", "TIMEOUT")
NO_TIME = "no time left"


def read_stages(path: pathlib.Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [(line.split("\t") + ["", "", ""])[:4] for line in path.read_text().splitlines() if line.strip()]


def read_variant(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        variant = path.stem.removeprefix("check-")
        return {"variant": variant, "checks": [], "errors": [f"no readable report: {type(error).__name__}: {error}"]}


def stage_lines(stages: list[list[str]]) -> list[str]:
    lines = [f"{'stage':<14} {'status':<8} {'seconds':>7}  detail"]
    for name, status, seconds, detail in stages:
        lines.append(f"{name:<14} {status:<8} {seconds:>7}  {detail}")
    return lines


def variant_lines(reports: list[dict]) -> list[str]:
    lines = [f"{'variant':<8} {'engine':<34} {'checks':<7} {'gRPC tok/s':>10} {'direct tok/s':>13} {'ratio':>6}"]
    for report in reports:
        checks = report.get("checks", [])
        passed = sum(bool(c.get("ok")) for c in checks)
        rates = [report.get(key) for key in ("grpc_tok_s", "direct_tok_s", "ratio")]
        shown = [f"{r:.1f}" if isinstance(r, (int, float)) else "-" for r in rates[:2]]
        shown.append(f"{rates[2]:.3f}" if isinstance(rates[2], (int, float)) else "-")
        lines.append(
            f"{report.get('variant', '?'):<8} {str(report.get('engine', '-'))[:34]:<34} {f'{passed}/{len(checks)}':<7}"
            f" {shown[0]:>10} {shown[1]:>13} {shown[2]:>6}"
        )
        speculation = report.get("speculation")
        if speculation:
            lines.append(
                f"  n-gram drafting / none: {speculation.get('ratio_1', 0):.2f}x at 1 stream, "
                f"{speculation.get('ratio_4', 0):.2f}x at 4; {speculation.get('accepted_draft_tokens')} of "
                f"{speculation.get('draft_tokens')} drafts accepted"
            )
        for check in checks:
            if not check.get("ok"):
                lines.append(f"  FAIL {check.get('check')}: {str(check.get('detail', ''))[:160]}")
        for error in report.get("errors", []):
            lines.append(f"  error: {str(error)[:160]}")
    return lines


def stage_failed(status: str, detail: str) -> bool:
    return status in BAD_STAGE or (status == "SKIP" and detail.startswith(NO_TIME))


def failed(stages: list[list[str]], reports: list[dict]) -> bool:
    return (
        any(stage_failed(status, detail) for _, status, _, detail in stages)
        or any(not c.get("ok") for r in reports for c in r.get("checks", []))
        or any(r.get("errors") for r in reports)
    )


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    stages = read_stages(pathlib.Path(argv[0]))
    reports = [read_variant(pathlib.Path(p)) for p in argv[1:]]
    lines = stage_lines(stages)
    if reports:
        lines += [""] + variant_lines(reports)
    bad = failed(stages, reports)
    skipped = sum(status == "SKIP" for _, status, _, _ in stages)
    result = ("FAILED" if bad else "all passed") + (f" ({skipped} stages skipped)" if skipped else "")
    lines += ["", "result: " + result]
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
