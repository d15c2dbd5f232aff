"""Schema-constrained decoding with llguidance.

A constraint is compiled once per (constraint, tokenizer) and cached; each
sequence gets its own matcher (a cheap copy of the compiled one). Every step
the engine fills that sequence's row of one batch bitmask, masks the logits,
samples, and feeds the sampled token back to the matcher.
"""

from typing import TYPE_CHECKING

from backend.lazy import exports

if TYPE_CHECKING:
    from backend.constraints.compiler import (
        MAX_JSON_DEPTH,
        CompiledConstraint,
        CompileReport,
        ConstraintCompiler,
        ConstraintError,
        json_depth,
        source_chars,
        to_grammar,
    )
    from backend.constraints.lanes import CompileLanes, TooManyCompiles
    from backend.constraints.limits import ConstraintLimits
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

if not TYPE_CHECKING:  # a type checker reads the imports above
    __getattr__, __dir__ = exports(__name__, __file__, __all__)
