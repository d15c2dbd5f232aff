"""Callers' fair-sharing weights as the settings give them (`caller_weights`), and the name that means
everyone: read when the settings are, before anything serves (service.callers applies them)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

ANY_CALLER = "*"


class CallerWeight(NamedTuple):
    name: str
    weight: float


def parse_weights(entries: Iterable[str], source: str) -> tuple[CallerWeight, ...]:
    """`name=weight` entries (the name may itself hold `=`, as a certificate subject does)."""
    weights = []
    for entry in entries:
        name, _, number = entry.strip().rpartition("=")
        try:
            weight = float(number)
        except ValueError:
            weight = math.nan
        if not name or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{source}: expected name=weight with a positive weight, got {entry!r}")
        weights.append(CallerWeight(name, weight))
    return tuple(weights)
