"""The real-size run's summary (bench/gpu/real_size.py's JSONs), for bench/gpu/report.py: per format
the weights' bytes per token, the limit the measured copy bandwidth sets at one stream, exllamav2's own
unpaged forward, and per stream count decode tokens/s through gRPC, exllamav2 driven directly on each
attention provider, their ratios and each rate as a fraction of the limit (n streams share one read of
the weights per step: n times the one-stream limit; the K/V they read is not counted). Standard library only.
"""

from __future__ import annotations

GRPC_TARGET, NEW_OVER_OLD_TARGET, ONE_STREAM_TARGET = 0.97, 1.5, 0.25


def lines(reports: list[dict]) -> list[str]:
    bandwidth = next((r.get("bandwidth") or {} for r in reports if r.get("layer") == "bandwidth"), {})
    gb_s = bandwidth.get("gb_s")
    out = [f"real size: copy bandwidth {gb_s or '-'} GB/s on {bandwidth.get('device', '-')}"]
    order = ("exl2", "gptq", "fp16")  # the run's order
    formats = sorted({r.get("format") for r in reports if r.get("layer") in ("direct", "grpc")},
                     key=lambda f: order.index(f) if f in order else len(order))
    for fmt in formats:
        direct = next((r for r in reports if r.get("format") == fmt and r.get("layer") == "direct"), {})
        served = next((r for r in reports if r.get("format") == fmt and r.get("layer") == "grpc"), {})
        out += format_lines(fmt, direct, served, gb_s)
    for report in reports:
        for error in report.get("errors", []):
            out.append(f"  error ({report.get('format', '')} {report.get('layer')}): {str(error)[:160]}")
    return out


def format_lines(fmt: str, direct: dict, served: dict, gb_s: float | None) -> list[str]:
    per_token = direct.get("weight_bytes_per_token") or served.get("weight_bytes_per_token")
    limit = gb_s * 1e9 / per_token if gb_s and per_token else None
    raw = (direct.get("raw_forward") or {}).get("tok_s")
    check = direct.get("load_check") or {}
    out = [f"{fmt}: {per_token / 1e9 if per_token else 0:.2f} GB of weights per token, limit {cell(limit)} tok/s at "
           f"one stream; loaded in {direct.get('load_s', '-')} s, logits {'finite' if check.get('finite') else 'NOT CHECKED'}; "
           f"exllamav2's own forward {cell(raw)} tok/s{fraction(raw, limit, 1)}{below(raw, limit, ONE_STREAM_TARGET, fmt)}"]
    by_provider = direct.get("direct_tok_s") or {}
    providers = list(by_provider)
    through_grpc = served.get("grpc_tok_s") or {}
    new = by_provider.get(served.get("attention") or (providers[0] if providers else ""), {})
    counts = list(dict.fromkeys([*through_grpc, *(n for rates in by_provider.values() for n in rates)]))
    for n in sorted(counts, key=int):
        cells = [f"gRPC {cell(through_grpc.get(n))}{fraction(through_grpc.get(n), limit, int(n))}"]
        cells += [f"direct {p} {cell(rates.get(n))}{fraction(rates.get(n), limit, int(n))}" for p, rates in by_provider.items()]
        ratio = ratio_of(through_grpc.get(n), new.get(n))
        if ratio is not None:
            cells.append(f"gRPC/direct {ratio:.3f}{' BELOW' if ratio < GRPC_TARGET else ''}")
        if len(providers) > 1:
            gain = ratio_of(by_provider[providers[0]].get(n), by_provider[providers[1]].get(n))
            if gain is not None:
                cells.append(f"{providers[0]}/{providers[1]} {gain:.2f}x")
        out.append(f"  {n:>3} streams: " + "; ".join(cells))
    for n, results in (direct.get("attention") or {}).items():
        cells = [f"{p} {cell(r.get('ms_per_call'))} ms (differs by {r.get('max_diff')})" for p, r in results.items()]
        out.append(f"  attention alone, 8B shape, {n} streams, one call (a step makes 32): " + "; ".join(cells))
    return out


def cell(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) and value >= 1 else (
        f"{value:.3f}" if isinstance(value, (int, float)) else "-")


def ratio_of(top, bottom) -> float | None:
    return top / bottom if isinstance(top, (int, float)) and isinstance(bottom, (int, float)) and bottom else None


def fraction(rate, limit: float | None, streams: int) -> str:
    share = ratio_of(rate, limit * streams if limit else None)
    return f" ({share:.2f} of limit)" if share is not None else ""


def below(rate, limit: float | None, target: float, fmt: str) -> str:
    share = ratio_of(rate, limit)
    return " BELOW 0.25" if fmt == "exl2" and share is not None and share < target else ""
