"""Checking finished output against the full JSON Schema (for non-strict constraints).

A non-strict constraint approximates keywords no grammar can enforce exactly
(oneOf, uniqueItems, not, if/then), so the output is validated afterwards and
the result reported, never assumed.
"""

from __future__ import annotations

import json

import jsonschema

from backend.types import ConstraintSpec


def json_output_problem(spec: ConstraintSpec, text: str) -> str:
    """Empty when `text` is JSON that satisfies the spec's schema, else what is wrong."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"output is not valid JSON: {exc}"
    schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
    validator_class = jsonschema.validators.validator_for(schema)
    error = jsonschema.exceptions.best_match(validator_class(schema).iter_errors(document))
    if error is None:
        return ""
    where = "/".join(str(part) for part in error.absolute_path)
    return f"output does not match the schema at /{where}: {error.message}"
