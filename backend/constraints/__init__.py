"""Schema-constrained decoding with llguidance.

A constraint is compiled once per (constraint, tokenizer) and cached; each
sequence gets its own matcher (a cheap copy of the compiled one). Every step
the engine fills that sequence's row of one batch bitmask, masks the logits,
samples, and feeds the sampled token back to the matcher.
"""

from backend.constraints.compiler import (
    MAX_JSON_DEPTH,
    CompiledConstraint,
    CompileReport,
    ConstraintCompiler,
    ConstraintError,
    ConstraintLimits,
    json_depth,
    source_chars,
    to_grammar,
)
from backend.constraints.lanes import CompileLanes, TooManyCompiles
from backend.constraints.spec import ConstraintSpec
from backend.constraints.state import ConstraintState, apply_bitmask
from backend.constraints.tokenizer import build_tokenizer
from backend.constraints.validation import json_output_problem

__all__ = [
    "apply_bitmask",
    "build_tokenizer",
    "CompiledConstraint",
    "CompileLanes",
    "CompileReport",
    "ConstraintCompiler",
    "ConstraintError",
    "ConstraintLimits",
    "ConstraintSpec",
    "ConstraintState",
    "json_depth",
    "json_output_problem",
    "MAX_JSON_DEPTH",
    "source_chars",
    "to_grammar",
    "TooManyCompiles",
]
