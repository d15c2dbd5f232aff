"""Checking finished output against the full JSON Schema (for non-strict constraints).

A non-strict constraint approximates keywords no grammar can enforce exactly
(oneOf, uniqueItems, not, if/then), so the output is validated afterwards and
the result reported, never assumed. Patterns are matched with the `regex`
package, which reads the dialect llguidance accepts (`\\p{L}`, `\\z`, ...)
where Python's `re` does not; what cannot be checked is said, not raised.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import regex

from backend.constraints.compiler import MAX_JSON_DEPTH, json_depth, source_text
from backend.constraints.spec import ConstraintSpec

if TYPE_CHECKING:  # jsonschema is imported when an output is first checked: it costs every process ~0.1 s at start
    import jsonschema
    from jsonschema.protocols import Validator


class _Unchecked(Exception):
    """A pattern the regex engine cannot compile: that keyword goes unchecked."""


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> regex.Pattern[str]:
    # \z (end of text, as in Rust) is \Z in Python's dialects.
    try:
        return regex.compile(pattern.replace(r"\z", r"\Z"))
    except (regex.error, ValueError, OverflowError) as exc:
        raise _Unchecked(f"pattern {pattern[:80]!r}: {exc}") from None


class _KeywordValidator(Protocol):
    """What a keyword function uses of the validator jsonschema hands it (its protocol omits `descend`)."""

    def is_type(self, instance: object, type: str) -> bool: ...

    def descend(
        self, instance: object, schema: object, path: str | None = None, schema_path: str | None = None
    ) -> Iterator[jsonschema.ValidationError]: ...


def _pattern(
    validator: _KeywordValidator, pattern: str, instance: object, schema: Mapping[str, object]
) -> Iterator[jsonschema.ValidationError]:
    # is_type is jsonschema's rule for each draft; isinstance, always true with it, narrows the type.
    if validator.is_type(instance, "string") and isinstance(instance, str) and not _compiled(pattern).search(instance):
        import jsonschema

        yield jsonschema.ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(
    validator: _KeywordValidator, patterns: Mapping[str, object], instance: object, schema: Mapping[str, object]
) -> Iterator[jsonschema.ValidationError]:
    if not (validator.is_type(instance, "object") and isinstance(instance, Mapping)):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _compiled(pattern).search(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _validator(schema: Mapping[str, object] | bool) -> Validator:
    import jsonschema

    base = jsonschema.validators.validator_for(schema)
    # types-jsonschema leaves extend() unannotated; it returns a validator class like `base`.
    extended: type[Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
        base, {"pattern": _pattern, "patternProperties": _pattern_properties}
    )
    return extended(schema)


def json_output_problem(spec: ConstraintSpec, text: str) -> str:
    """Empty when `text` is JSON that satisfies the spec's schema, else what is wrong or unchecked."""
    if json_depth(text) > MAX_JSON_DEPTH:
        return f"output nests deeper than {MAX_JSON_DEPTH} levels; not validated against the schema"
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"output is not valid JSON: {exc}"
    schema = json.loads(source_text(spec)) if spec.kind == "json_schema" else {"type": "object"}
    import jsonschema

    try:
        error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(document))
    except _Unchecked as exc:
        return f"output could not be fully validated: {exc}"
    except Exception as exc:  # e.g. a $ref that cannot be resolved offline: report, never fail the stream
        return f"output could not be fully validated: {type(exc).__name__}: {str(exc)[:200]}"
    if error is None:
        return ""
    where = "/".join(str(part) for part in error.absolute_path)
    return f"output does not match the schema at /{where}: {error.message}"
