"""The constraint a chat generates under: the caller's as is, or one grammar of its tools and reasoning.

The grammar (backend.tools.grammar) is built when the chat needs one: forced or auto calls,
reasoning on or with a budget (or opened by the template), or a caller's constraint that must
start after the reasoning. Each tool's schema is compiled first, so one that llguidance cannot
enforce is named by its field; the engine compiles (service.compiles).
"""

from __future__ import annotations

import json

from backend.constraints import ConstraintError, ConstraintSpec, to_grammar
from backend.tools import GrammarBuilder, ReasoningRule
from service.chat.formats import ChatFormats
from service.chat.plan import ToolPlan
from service.compiles import CompileGate
from service.errors import FieldViolation, invalid_argument
from tokenspout.v1 import generation_pb2 as pb

COMPOSED = "composed"
"""The ConstraintSpec kind of a grammar built here (backend.constraints.compiler takes it as is)."""


async def chat_constraint(
    plan: ToolPlan, formats: ChatFormats, constraint: ConstraintSpec | None, opened_reasoning: bool,
    compiles: CompileGate,
) -> ConstraintSpec | None:
    """`grammar_spec`, its parts compiled: each called tool's schema, the caller's constraint, then the whole.
    Raises INVALID_ARGUMENT naming what cannot be enforced (ConstraintError of the caller's own, as it is)."""
    for i, tool in enumerate(plan.tools if plan.calls_parsed else ()):
        if isinstance(tool.parameters, dict):
            schema = ConstraintSpec("json_schema", json.dumps(tool.parameters))
            try:
                await compiles.compile(schema)
            except ConstraintError as exc:
                where = f"chat.tools[{i}].parameters"
                raise invalid_argument([FieldViolation(where, f"cannot be enforced: {exc}")]) from None
    builder = GrammarBuilder(lambda marker: False)  # markers are spelled as text (see docs/api.md)
    spec = grammar_spec(plan, formats, constraint, opened_reasoning, builder)
    if spec is not None and spec.kind == COMPOSED:
        if constraint is not None:  # its own problems name its own field
            await compiles.compile(constraint)
        try:
            await compiles.compile(spec)
        except ConstraintError as exc:
            raise invalid_argument([FieldViolation("chat", f"the grammar of its tools and reasoning: {exc}")]) from None
    return spec


def grammar_spec(
    plan: ToolPlan, formats: ChatFormats, constraint: ConstraintSpec | None, opened_reasoning: bool,
    builder: GrammarBuilder,
) -> ConstraintSpec | None:
    """The constraint this chat generates under: the caller's as is, or one grammar with the tools and reasoning."""
    reasoning_on = plan.reasoning_mode == pb.REASONING_MODE_ON or plan.budget_tokens > 0 or (
        opened_reasoning and plan.reasoning_mode != pb.REASONING_MODE_OFF)
    forced = plan.choice in ("required", "named")
    if not reasoning_on and plan.choice == "none":
        return constraint
    reasoning = None
    if reasoning_on and formats.reasoning is not None:
        reasoning = ReasoningRule(formats.reasoning, opened_reasoning, plan.budget_tokens)
    subs: list[dict[str, object]] = []
    if plan.choice != "none" and formats.tools is not None:
        tools = [t for t in plan.tools if plan.choice != "named" or t.name == plan.named]
        answer = builder.tool_answer(formats.tools, tools, forced, plan.parallel)
    elif constraint is not None:
        answer, subs = builder.constraint_answer(to_grammar(constraint))
    else:
        answer = builder.free_answer()
    return ConstraintSpec(COMPOSED, builder.compose(reasoning, answer, subs))
