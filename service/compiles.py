"""A caller's wait for its constraint's compile.

The engine compiles (backend.constraints.lanes: its own threads, two lanes, a bound on large
compiles running at once, a cache). Here a caller waits at most `timeout_s` for one; a compile
that outlives its caller's budget still finishes and is cached, so a retry is instant.
"""

from __future__ import annotations

import asyncio

from backend import Engine
from backend.constraints import CompileReport, ConstraintSpec, TooManyCompiles
from service.errors import compile_budget_exceeded, too_many_compiles


class CompileGate:
    def __init__(self, engine: Engine, timeout_s: float) -> None:
        self._engine = engine
        self._timeout_s = timeout_s

    async def compile(self, spec: ConstraintSpec) -> CompileReport:
        """Raises ConstraintError or ServiceError (too many compiles, or the budget spent)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._engine.compile(spec)), self._timeout_s)
        except TooManyCompiles as exc:
            raise too_many_compiles(exc.running) from None
        except TimeoutError:
            raise compile_budget_exceeded(self._timeout_s) from None
