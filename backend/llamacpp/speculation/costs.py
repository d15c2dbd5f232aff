"""What one llama_decode costs on this machine, learned from the decodes the engine runs.

llama.cpp's per-sequence cache splits a batch into forward passes that take the
same number of rows from every sequence still in it, so a decode's shape is its
passes, its rows and its rows with logits. Measured here (2 cores, the embedded
model, `docs/benchmarks.md`): time = 8.5 ms a pass + 4.6 ms a row within a few
percent over 2 to 40 rows and 1 to 4 passes, so DecodeCosts fits that line by
least squares on relative error, recent decodes weighing more. Prompt chunks
count too, so the row cost stays known when every decoding step has the same
shape; a row without logits counts as the share of a row's work that is not the
output layer's.

A few percent is not all: some shapes sit well off the line. A lone row (one
sequence, plain decoding) takes a faster path, 9.8 ms where the line says 13.1,
and the output layer's matrix kernel works in tiles of rows, so one sequence's
decode of 3 rows with logits costs nearly what 4 do and 9 cost 5 ms more than 8.
A planner that sees only the line drafts lengths that land on the dear side.
So each shape seen lately keeps its own correction to the line (its time over
the line's estimate), and the line answers for shapes not seen.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

_MEMORY = 0.98
"""Each decode's weight shrinks by this factor at every later one (a memory of some 50 decodes)."""
_PRIOR_WEIGHT = 0.5
"""The prior weighs as much as this many decodes (little: where decodes of a few shapes leave the pass
and the row cost hard to tell apart, it still decides): decodes of _PRIOR_SHAPES as long as a pass costing
_PRIOR_PASS_ROWS rows (as measured here) predicts, scaled to the first decode seen."""
_PRIOR_PASS_ROWS = 1.8
_PRIOR_SHAPES = ((1, 4), (2, 8), (1, 64))
_SHAPE_MEMORY = 0.8
"""A shape's correction follows its last few decodes; it starts from the line (a first decode moves it halfway)."""
_SHAPE_BOUNDS = (0.5, 2.0)
"""One decode moves a shape's correction by at most these factors (a decode stalled by another process
must not make a shape look unaffordable for long)."""
_SHAPES_KEPT = 256
"""Shapes with a correction; the least recently seen is dropped first."""

Shape = tuple[int, int, int]
"""A decode's forward passes, rows, and rows with logits."""


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
        self._shapes: collections.OrderedDict[Shape, list[float]] = collections.OrderedDict()
        """Per shape: decayed sums of its decodes' weights and of their time over the line's estimate."""

    @classmethod
    def given(
        cls, pass_s: float, row_s: float, shapes: dict[Shape, float], plain_row_share: float = 0.8
    ) -> DecodeCosts:
        """Costs known beforehand (a closed study replayed the planner at fixed costs: `git show
        470e819:bench/planner.py`): the line, and the seconds of the shapes off it."""
        costs = cls(plain_row_share)
        costs.pass_s, costs.row_s = pass_s, row_s
        costs._prior = (pass_s, row_s)  # known: it never falls back on the first decode's guess
        for (passes, rows, logit_rows), seconds in shapes.items():
            costs._shapes[passes, rows, logit_rows] = [1.0, seconds / costs._line(passes, rows, logit_rows)]
        return costs

    @property
    def known(self) -> bool:
        return self._prior is not None

    def record(self, passes: int, rows: int, logit_rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rows_worth = self._rows_worth(rows, logit_rows)
        if self._prior is None:
            row_s = seconds / self.work(passes, rows, logit_rows)
            self._prior = (_PRIOR_PASS_ROWS * row_s, row_s)
            self.pass_s, self.row_s = self._prior
        if not passes == rows == 1:  # the lone row is far off the line and the commonest shape: it would bend it
            p, r, t = passes, rows_worth, seconds
            terms = (p * p / t**2, p * r / t**2, r * r / t**2, p / t, r / t)
            self._sums = [_MEMORY * s + v for s, v in zip(self._sums, terms)]
            self.pass_s, self.row_s = self._fit()
        self._correct((passes, rows, logit_rows), seconds)

    def estimate(self, passes: int, rows: int, logit_rows: int) -> float:
        weights = self._shapes.get((passes, rows, logit_rows))
        correction = weights[1] / weights[0] if weights else 1.0
        return self._line(passes, rows, logit_rows) * correction

    def work(self, passes: int, rows: int, logit_rows: int) -> float:
        """A decode's size in rows with logits, by the prior's fixed measure: the time of decodes of any shape
        (prompt chunks and decoding steps alike) over it compares the pace they ran at."""
        return _PRIOR_PASS_ROWS * passes + self._rows_worth(rows, logit_rows)

    def _line(self, passes: int, rows: int, logit_rows: int) -> float:
        return passes * self.pass_s + self._rows_worth(rows, logit_rows) * self.row_s

    def _correct(self, shape: Shape, seconds: float) -> None:
        line = self._line(*shape)
        if line <= 0:
            return
        low, high = _SHAPE_BOUNDS
        weights = self._shapes.pop(shape, None) or [1.0, 1.0]  # a shape not seen yet starts on the line
        current = weights[1] / weights[0]
        ratio = min(max(seconds / line, current * low), current * high)
        self._shapes[shape] = [_SHAPE_MEMORY * weights[0] + 1, _SHAPE_MEMORY * weights[1] + ratio]
        if len(self._shapes) > _SHAPES_KEPT:
            self._shapes.popitem(last=False)

    def _rows_worth(self, rows: int, logit_rows: int) -> float:
        return logit_rows + self.plain_row_share * (rows - logit_rows)

    def _fit(self) -> tuple[float, float]:
        """Least squares on relative error over the decodes (decayed) and the prior's decodes."""
        assert self._prior is not None  # the first decode sets it, before any fit
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
