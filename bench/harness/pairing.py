"""Comparing sides on a noisy machine: every item goes to every side in turn, the order rotating, so
whatever the host does that minute hits all sides alike; then medians, and ratios of medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

Item = TypeVar("Item")


def rotated(names: Sequence[str], turn: int) -> list[str]:
    """`names` starting at `turn`: each side goes first in turn."""
    k = turn % len(names) if names else 0
    return [*names[k:], *names[:k]]


def alternate(sides: Mapping[str, Callable[[Item], float]], items: Iterable[Item]) -> dict[str, list[float]]:
    """Each item measured on every side, the order rotating with each item: each side's samples."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for turn, item in enumerate(items):
        for name in rotated(list(sides), turn):
            samples[name].append(sides[name](item))
    return samples


def medians(samples: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def span(values: Iterable[float | None], digits: int = 2) -> str:
    """`low-high` of the values that exist (one value alone when they agree), "-" when none do."""
    present = sorted(value for value in values if value is not None)
    if not present:
        return "-"
    low, high = f"{present[0]:.{digits}f}", f"{present[-1]:.{digits}f}"
    return low if low == high else f"{low}-{high}"
