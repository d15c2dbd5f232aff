"""What one llama_decode costs on this machine, learned from the decodes the engine runs.

llama.cpp's per-sequence cache splits a batch into forward passes that take the
same number of rows from every sequence still in it, so a decode's shape is its
passes and its rows. Measured here (2 cores, the embedded model,
`docs/benchmarks.md`): time = 8.5 ms a pass + 4.6 ms a row within a few percent,
over 2 to 40 rows and 1 to 4 passes, but for one lone row (one sequence, plain
decoding), which llama.cpp computes on a faster path: 9.8 ms, where the line
says 13.1. So DecodeCosts keeps that case apart (a moving average), and fits
the others as `passes * pass_s + rows * row_s` by least squares on relative
error, recent decodes weighing more. Prompt chunks count too, so the row cost
stays known when every decoding step has the same shape; a row without logits
counts as the share of a row's work that is not the output layer's.
"""

from __future__ import annotations

from collections.abc import Sequence

_MEMORY = 0.98
"""Each decode's weight shrinks by this factor at every later one (a memory of some 50 decodes)."""
_PRIOR_WEIGHT = 0.5
"""The prior weighs as much as this many decodes (little: where decodes of a few shapes leave the pass
and the row cost hard to tell apart, it still decides): decodes of _PRIOR_SHAPES as long as a pass costing
_PRIOR_PASS_ROWS rows (as measured here) predicts, scaled to the first decode seen."""
_PRIOR_PASS_ROWS = 1.8
_PRIOR_SHAPES = ((1, 4), (2, 8), (1, 64))
_SOLO_MEMORY = 0.9


def passes_for(rows_per_sequence: Sequence[int]) -> int:
    """Forward passes llama.cpp makes for a batch of these per-sequence row counts: it splits a batch
    into pieces taking the same number of rows from every sequence still in it."""
    return len(set(rows_per_sequence))


class DecodeCosts:
    def __init__(self, plain_row_share: float = 0.8) -> None:
        self.plain_row_share = plain_row_share
        """What a row without logits costs relative to one with (see GgufModel.plain_row_share)."""
        self._sums = [0.0] * 5  # decayed sums of p^2, p r, r^2, p t, r t, each over t^2
        self._prior: tuple[float, float] | None = None
        self.pass_s = self.row_s = 0.0
        self.solo_s: float | None = None
        """Seconds a decode of one lone row takes."""

    @classmethod
    def given(cls, pass_s: float, row_s: float, solo_s: float, plain_row_share: float = 0.8) -> DecodeCosts:
        """Costs known beforehand instead of learned (bench/planner.py replays the planner at fixed costs)."""
        costs = cls(plain_row_share)
        costs.pass_s, costs.row_s, costs.solo_s = pass_s, row_s, solo_s
        costs._prior = (pass_s, row_s)  # known: it never falls back on the first decode's guess
        return costs

    @property
    def known(self) -> bool:
        return self._prior is not None

    def record(self, passes: int, rows: int, logit_rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if passes == rows == 1:
            self.solo_s = seconds if self.solo_s is None else _SOLO_MEMORY * self.solo_s + (1 - _SOLO_MEMORY) * seconds
        rows_worth = self._rows_worth(rows, logit_rows)
        if self._prior is None:
            row_s = seconds / (_PRIOR_PASS_ROWS * passes + rows_worth)
            self._prior = (_PRIOR_PASS_ROWS * row_s, row_s)
            self.pass_s, self.row_s = self._prior
        if passes == rows == 1:
            return
        m, p, r, t = _MEMORY, passes, rows_worth, seconds
        self._sums = [m * s + v for s, v in zip(self._sums, (p * p / t**2, p * r / t**2, r * r / t**2, p / t, r / t))]
        self.pass_s, self.row_s = self._fit()

    def estimate(self, passes: int, rows: int, logit_rows: int) -> float:
        if passes == rows == 1 and self.solo_s is not None:
            return self.solo_s
        return passes * self.pass_s + self._rows_worth(rows, logit_rows) * self.row_s

    def _rows_worth(self, rows: int, logit_rows: int) -> float:
        return logit_rows + self.plain_row_share * (rows - logit_rows)

    def _fit(self) -> tuple[float, float]:
        """Least squares on relative error over the decodes (decayed) and the prior's decodes."""
        pp, pr, rr, pt, rt = self._sums
        weight = _PRIOR_WEIGHT / len(_PRIOR_SHAPES)
        for p, r in _PRIOR_SHAPES:
            t = p * self._prior[0] + r * self._prior[1]
            pp, pr, rr = pp + weight * p * p / t**2, pr + weight * p * r / t**2, rr + weight * r * r / t**2
            pt, rt = pt + weight * p / t, rt + weight * r / t
        determinant = pp * rr - pr * pr
        pass_s, row_s = (pt * rr - pr * rt) / determinant, (pp * rt - pr * pt) / determinant
        if pass_s < 0 or row_s < 0:  # the line through the origin that fits best, in whichever cost is left
            return (max(pt / pp, 0.0), 0.0) if row_s < 0 else (0.0, max(rt / rr, 0.0))
        return pass_s, row_s
