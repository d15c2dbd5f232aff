"""The GPU check's short summary: each stage of run.sh, then per variant (fp16, gptq, exl2) whether
it ran paged and on which attention provider, the paged smoke's result, the served checks, and
decode tokens/s through gRPC against exllamav2 directly at each stream count, with their ratio.

    python3 bench/gpu/report.py STAGES.tsv [SMOKE.json | CHECK.json ...]   # prints summary.txt; exit 1 if anything failed

Standard library only: it must work when nothing else installed (the summary is most needed then).
A stage line in STAGES.tsv is `name<TAB>status<TAB>seconds<TAB>detail`, status one of ok, FAIL,
TIMEOUT or SKIP; a stage skipped for want of time (detail "no time left ...") counts as a failure,
one skipped for want of a GPU or of a stage it needs does not. A variant's JSON may be missing or
cut short (a stage killed at its limit): that is reported as such, never as a crash. A paged
smoke's JSON (bench/gpu/paged_smoke.py, "kind": "paged_smoke") holds one result per model; a model
that failed it fails the run. A ratio under its target is shown, not failed: it is a measurement.
"""

from __future__ import annotations

import json
import pathlib
import sys

try:
    from bench.gpu import real_report
except ImportError:  # run as a file, with nothing of the project on the path
    import real_report  # type: ignore[no-redef]

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
        variant = path.stem.removeprefix("check-").removeprefix("smoke-")
        problem = f"no readable report: {type(error).__name__}: {error}"
        if path.name.startswith("real-"):
            parts = path.stem.split("-")  # real-FORMAT-LAYER or real-bandwidth
            return {"kind": "real_size", "format": parts[1], "layer": parts[-1], "errors": [f"{path.name}: {problem}"]}
        if path.name.startswith("smoke-"):
            return {"kind": "paged_smoke", "ok": False, "models": [], "errors": [f"{path.name}: {problem}"]}
        return {"variant": variant, "checks": [], "errors": [problem]}


def split_reports(reports: list[dict]) -> tuple[list[dict], list[dict]]:
    """(paged smoke reports, served variants' reports); the real-size run's are neither (real_report.py)."""
    smokes = [r for r in reports if r.get("kind") == "paged_smoke"]
    return smokes, [r for r in reports if r.get("kind") not in ("paged_smoke", "real_size")]


def smoke_results(smokes: list[dict]) -> dict[str, dict]:
    """Each model's paged smoke result by variant name."""
    return {model.get("variant", "?"): model for smoke in smokes for model in smoke.get("models", [])}


def stage_lines(stages: list[list[str]]) -> list[str]:
    lines = [f"{'stage':<16} {'status':<8} {'seconds':>7}  detail"]
    for name, status, seconds, detail in stages:
        lines.append(f"{name:<16} {status:<8} {seconds:>7}  {detail}")
    return lines


def number(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def paged_of(report: dict) -> str:
    return {True: "yes", False: "no"}.get(report.get("paged"), "-")


def smoke_line(result: dict) -> str:
    if result.get("error"):
        return f"  paged smoke FAIL: {str(result['error'])[:160]}"
    jobs = result.get("jobs", {}).values()
    identical, at_tie = sum(bool(j.get("identical")) for j in jobs), sum(bool(j.get("parted_at_tie")) for j in jobs)
    stats = result.get("provider_stats", {})
    return (f"  paged smoke {'ok' if result.get('ok') else 'FAIL'} ({result.get('provider')}): {identical}/{len(jobs)} "
            f"jobs token-identical to unpaged{f' ({at_tie} parted at a near tie)' if at_tie else ''}, "
            f"{result.get('max_active_jobs', 0)} at once, {stats.get('largest_kvcache_batch', 0)} sequences in one "
            f"attention call, {result.get('shared_prefix_cached_tokens', 0)} prefix tokens reused")


def rate_lines(report: dict) -> list[str]:
    """Decode tok/s per stream count: gRPC, direct, ratio (the one-stream figures alone in older reports)."""
    rates = report.get("rates") or {
        "grpc_tok_s": {"1": report.get("grpc_tok_s")}, "direct_tok_s": {"1": report.get("direct_tok_s")},
        "ratio": {"1": report.get("ratio")},
    }
    through_grpc = rates.get("grpc_tok_s", {})
    if not any(isinstance(v, (int, float)) for v in through_grpc.values()):
        return []
    target = rates.get("target")
    cells = []
    for n in through_grpc:
        ratio = rates.get("ratio", {}).get(n)
        below = isinstance(ratio, (int, float)) and target and ratio < target
        cells.append(f"{n}: {number(through_grpc[n], 1)} / {number(rates.get('direct_tok_s', {}).get(n), 1)}"
                     f" = {number(ratio, 3)}{' BELOW' if below else ''}")
    direct = f", direct on {report['direct_provider']}" if report.get("direct_provider") else ""
    return [f"  decode tok/s gRPC / direct = ratio by streams{f' (target {target})' if target else ''}{direct}: "
            + "; ".join(cells)]


def variant_lines(reports: list[dict], smokes: dict[str, dict] | None = None) -> list[str]:
    smokes = dict(smokes or {})
    lines = [f"{'variant':<8} {'paged':<5} {'provider':<10} {'engine':<34} {'checks':<7} {'gRPC tok/s':>10} "
             f"{'direct tok/s':>13} {'ratio':>6}"]
    for report in reports:
        checks = report.get("checks", [])
        passed = sum(bool(c.get("ok")) for c in checks)
        lines.append(
            f"{report.get('variant', '?'):<8} {paged_of(report):<5} {str(report.get('attention_provider', '-')):<10} "
            f"{str(report.get('engine', '-'))[:34]:<34} {f'{passed}/{len(checks)}':<7}"
            f" {number(report.get('grpc_tok_s'), 1):>10} {number(report.get('direct_tok_s'), 1):>13}"
            f" {number(report.get('ratio'), 3):>6}"
        )
        if report.get("variant") in smokes:
            lines.append(smoke_line(smokes.pop(report["variant"])))
        lines += rate_lines(report)
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
    for variant, result in smokes.items():  # smoked, never served (a stage cut or skipped)
        lines.append(f"{variant:<8} {'-':<5} {str(result.get('provider', '-')):<10} (not served)")
        lines.append(smoke_line(result))
    return lines


def stage_failed(status: str, detail: str) -> bool:
    return status in BAD_STAGE or (status == "SKIP" and detail.startswith(NO_TIME))


def failed(stages: list[list[str]], reports: list[dict]) -> bool:
    return (
        any(stage_failed(status, detail) for _, status, _, detail in stages)
        or any(not c.get("ok") for r in reports for c in r.get("checks", []))
        or any(r.get("errors") for r in reports)
        or any(r.get("kind") == "paged_smoke" and not r.get("ok") for r in reports)
    )


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    stages = read_stages(pathlib.Path(argv[0]))
    reports = [read_variant(pathlib.Path(p)) for p in argv[1:]]
    lines = stage_lines(stages)
    smokes, variants = split_reports(reports)
    if variants or smokes:
        lines += [""] + variant_lines(variants, smoke_results(smokes))
        lines += [f"  paged smoke error: {str(e)[:160]}" for smoke in smokes for e in smoke.get("errors", [])]
    real = [r for r in reports if r.get("kind") == "real_size"]
    if real:
        lines += [""] + real_report.lines(real)
    bad = failed(stages, reports)
    skipped = sum(status == "SKIP" for _, status, _, _ in stages)
    result = ("FAILED" if bad else "all passed") + (f" ({skipped} stages skipped)" if skipped else "")
    lines += ["", "result: " + result]
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
