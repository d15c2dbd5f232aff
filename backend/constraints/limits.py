"""llguidance's limits for one constraint, as the server's settings declare them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.setting import Group, setting

if TYPE_CHECKING:
    import llguidance


@dataclass(frozen=True)
class ConstraintLimits:
    """llguidance's parser limits for one constraint, explicit (its own defaults, except where noted);
    past them a constraint is INVALID_ARGUMENT. The server's settings are these names after `constraint_`."""

    max_items_in_row: int = setting(
        2000, "llguidance: most alternatives in one grammar rule.", Group.CONSTRAINTS, values="above 0")
    lexer_fuel: int = setting(  # about 50 per microsecond
        1_000_000, "llguidance: work allowed to build a constraint's lexer.", Group.CONSTRAINTS, values="above 0")
    step_lexer_fuel: int = setting(  # about 14 per microsecond
        200_000, "llguidance: lexer work allowed per token mask.", Group.CONSTRAINTS, values="above 0")
    step_max_items: int = setting(
        50_000, "llguidance: parser items allowed per token mask.", Group.CONSTRAINTS, values="above 0")
    max_lexer_states: int = setting(  # llguidance's own default: 250,000
        50_000, "llguidance: lexer states (1-2 kB each, shared by every matcher of one constraint) per "
        "constraint.", Group.CONSTRAINTS, values="above 0")
    max_grammar_size: int = setting(
        500_000, "llguidance: symbols in a compiled grammar.", Group.CONSTRAINTS, values="above 0")
    cache_mb: float = setting(  # the estimate: estimated_bytes
        512, "Memory the compiled-constraint cache may hold, estimated at 128 bytes per byte of constraint, "
        "besides its 256-entry cap.", Group.CONSTRAINTS, values="MB, above 0")

    def __post_init__(self) -> None:
        if min(dataclasses.astuple(self)) <= 0:
            raise ValueError("constraint_* limits must be positive")

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_mb * (1 << 20))

    def parser_limits(self) -> llguidance.LLParserLimits:
        import llguidance  # here: the supervisor reads these settings without loading llguidance

        # Terse errors: a verbose one dumps the parser state, which can run to megabytes.
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )
