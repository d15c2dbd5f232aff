"""What a request's output must match, as the service validated it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConstraintSpec:
    """Hashable, so it keys the compile cache."""

    kind: str  # json_schema, json_object, regex, grammar or choice
    value: str | tuple[str, ...] = ""
    strict: bool = True
    """Refuse what cannot be enforced exactly; when False, approximate it (and validate afterwards)."""
    whitespace_flexible: bool = False
    max_whitespace: int | None = None
