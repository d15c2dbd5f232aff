"""Where two greedy runs of the same prompt part, and whether FP16 rounding explains it: the rule
bench/gpu/checks.py and bench/gpu/paged_smoke.py judge partings by (model_check.py keeps the same margin
as SAFE_MARGIN, for a script that runs with nothing of the project imported)."""

from __future__ import annotations

TIE_MARGIN = 0.03
"""Top-two logprob gap under which FP16 rounding may pick either token: a parting there is rounding, not a fault."""


def first_parting(a: list, b: list) -> int | None:
    """The first position where two token lists differ by id (or where one ends), None if equal."""
    for index, (left, right) in enumerate(zip(a, b)):
        if left.id != right.id:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two_margin(token) -> float:
    top = sorted((alt.logprob for alt in token.top_logprobs), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def token_text(tokens: list) -> str:
    return b"".join(t.bytes if t.bytes else t.text.encode() for t in tokens).decode(errors="replace")
