"""Checks on one protobuf field at a time, each problem added to a list of violations: optional
scalars against their ranges, repeated strings against a count and a length, printable ids."""

from __future__ import annotations

import math
from collections.abc import Sequence

from google.protobuf.message import Message

from service.errors import FieldViolation


class RangeChecker:
    """Checks the `optional` scalar fields of one message and collects the set ones."""

    def __init__(self, prefix: str, message: Message, violations: list[FieldViolation]) -> None:
        self._prefix = prefix
        # The set fields, read once: a request sets few of the many a check looks at.
        self._set = {field.name: value for field, value in message.ListFields()}
        self._violations = violations
        self._values: dict[str, float | int] = {}

    def range(self, name: str, low: float, high: float, low_open: bool = False) -> None:
        if name not in self._set:
            return
        value = self._set[name]
        in_range = (low < value if low_open else low <= value) and value <= high
        if isinstance(value, float) and not math.isfinite(value) or not in_range:
            bracket = "(" if low_open else "["
            self._violations.append(FieldViolation(f"{self._prefix}.{name}", f"must be in {bracket}{low}, {high}]"))
        else:
            self._values[name] = value

    def values(self) -> dict[str, float | int]:
        return dict(self._values)

    def has(self, name: str) -> bool:
        """The field was set and in range."""
        return name in self._values

    def real(self, name: str, default: float) -> float:
        """A float field's value when it was set and in range, else `default`."""
        return float(self._values.get(name, default))

    def integer(self, name: str, default: int) -> int:
        """An integer field's value when it was set and in range, else `default`."""
        return int(self._values.get(name, default))


def checked(
    message: Message, prefix: str, violations: list[FieldViolation], **ranges: tuple[float, float] | tuple[float, float, bool]
) -> dict[str, float | int]:
    """The set fields of a small message, each checked against its (low, high[, low_open]) range."""
    check = RangeChecker(prefix, message, violations)
    for name, bounds in ranges.items():
        check.range(name, *bounds)
    return check.values()


def listed_strings(name: str, values: Sequence[str], most: int, longest: int) -> list[FieldViolation]:
    """Checks a repeated string field: at most `most` entries of 1 to `longest` characters."""
    if len(values) > most:
        return [FieldViolation(name, f"at most {most}")]
    return [
        FieldViolation(f"{name}[{i}]", f"must have 1 to {longest} characters")
        for i, value in enumerate(values)
        if not 0 < len(value) <= longest
    ]


def printable_ascii(text: str) -> bool:
    """Request ids go into logs and metadata: no control characters, no line breaks."""
    return all(" " <= c <= "~" for c in text)
