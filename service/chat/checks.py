"""A chat's tools, tool choice, history and reasoning, checked at the edge, each problem a field violation.

Made into a ChatTurn (service.chat.turn): what the chat asks (ToolPlan), this server's formats and the
caller's constraint. A tool's schema is held to a constraint's bounds (size, depth, a JSON object);
whether llguidance can enforce it is learned when the turn's grammar compiles (service.chat.grammar).
"""

from __future__ import annotations

import json
import re

from backend.constraints import MAX_JSON_DEPTH, ConstraintSpec, json_depth
from backend.tools import ToolSchema
from service.chat.formats import ChatFormats
from service.chat.plan import ToolPlan
from service.chat.turn import ChatTurn
from service.errors import FieldViolation
from service.fields import printable_ascii
from tokenspout.v1 import generation_pb2 as pb

MAX_TOOLS = 128
MAX_CALL_ID_LENGTH = 64
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_chat(
    chat: pb.Chat, formats: ChatFormats, constraint: ConstraintSpec | None, max_schema_chars: int,
    violations: list[FieldViolation],
) -> ChatTurn:
    """The chat's turn: its tools, choice, history and reasoning checked against this server's formats, each
    problem added to `violations`. `constraint` is the caller's (checked on its own), which calls cannot take;
    `max_schema_chars` bounds the tools' schemas as it bounds a constraint (they become one grammar)."""
    tools, descriptions = _tools(chat, max_schema_chars, violations)
    names = {tool.name for tool in tools}
    choice, named = _choice(chat, names, violations)
    if choice != "none" and formats.tools is None:
        violations.append(
            FieldViolation("chat.tools", "this model cannot take tools (no chat template, or tool_call_format = none)"))
    _history(chat, names, violations)
    mode, budget = chat.reasoning.mode, chat.reasoning.budget_tokens
    if mode == pb.REASONING_MODE_OFF and budget:
        violations.append(FieldViolation("chat.reasoning.budget_tokens", "needs reasoning that is not off"))
    if (mode == pb.REASONING_MODE_ON or budget) and formats.reasoning is None:
        violations.append(FieldViolation("chat.reasoning.mode", "this server parses no reasoning (reasoning_format = none)"))
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    plan = ToolPlan(tuple(tools), tuple(descriptions), choice, named, parallel, mode, budget)
    if plan.calls_parsed and constraint is not None:
        violations.append(FieldViolation("constraint", "cannot be combined with tool calls (set chat.tool_choice to none)"))
    return ChatTurn(formats, plan, constraint)


def chat_bytes(chat: pb.Chat) -> int:
    """A chat's text as UTF-8: its messages, and the tools, calls and reasoning rendered with them."""
    size = 0
    for m in chat.messages:
        size += len(m.content.encode()) + len(m.role.encode()) + len(m.reasoning.encode())
        size += sum(len(c.name.encode()) + len(c.arguments.encode()) for c in m.tool_calls)
    return size + sum(len(t.name.encode()) + len(t.description.encode()) + len(t.parameters.encode()) for t in chat.tools)


def _tools(chat: pb.Chat, max_schema_chars: int, violations: list[FieldViolation]) -> tuple[list[ToolSchema], list[str]]:
    if len(chat.tools) > MAX_TOOLS:
        violations.append(FieldViolation("chat.tools", f"{len(chat.tools)} tools; at most {MAX_TOOLS}"))
        return [], []
    total = sum(len(tool.parameters) for tool in chat.tools)
    if total > max_schema_chars:  # together they become one grammar
        violations.append(FieldViolation("chat.tools", f"{total} characters of schemas; at most {max_schema_chars} together"))
        return [], []
    tools, descriptions, seen = [], [], set()
    for i, tool in enumerate(chat.tools):
        where = f"chat.tools[{i}]"
        if not _TOOL_NAME.fullmatch(tool.name):
            violations.append(FieldViolation(f"{where}.name", "1 to 64 characters of A-Z, a-z, 0-9, _ and -"))
        elif tool.name in seen:
            violations.append(FieldViolation(f"{where}.name", f"{tool.name!r} is defined twice"))
        seen.add(tool.name)
        schema = _schema(tool.parameters, f"{where}.parameters", max_schema_chars, violations)
        tools.append(ToolSchema(tool.name, schema))
        descriptions.append(tool.description)
    return tools, descriptions


def _schema(text: str, where: str, max_chars: int, violations: list[FieldViolation]) -> dict[str, object] | bool:
    """A tool's parameters schema, under the bounds of a constraint's (size, depth, a JSON object)."""
    if not text:
        return True
    if len(text) > max_chars:
        violations.append(FieldViolation(where, f"at most {max_chars} characters"))
        return True
    if json_depth(text) > MAX_JSON_DEPTH:
        violations.append(FieldViolation(where, f"nests deeper than {MAX_JSON_DEPTH} levels"))
        return True
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        violations.append(FieldViolation(where, f"is not valid JSON: {exc.msg}"))
        return True
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        violations.append(FieldViolation(where, "must be a JSON Schema of an object"))
        return True
    return schema


def _choice(chat: pb.Chat, names: set[str], violations: list[FieldViolation]) -> tuple[str, str]:
    which = chat.tool_choice.WhichOneof("choice")
    if which == "name":
        if chat.tool_choice.name not in names:
            violations.append(FieldViolation("chat.tool_choice.name", f"no tool is named {chat.tool_choice.name!r}"))
        return "named", chat.tool_choice.name
    mode = chat.tool_choice.mode if which == "mode" else pb.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode == pb.TOOL_CHOICE_MODE_UNSPECIFIED:
        return ("auto" if names else "none"), ""
    if mode == pb.TOOL_CHOICE_MODE_NONE:
        return "none", ""
    if not names:
        violations.append(FieldViolation("chat.tool_choice", "needs chat.tools"))
        return "none", ""
    return ("required" if mode == pb.TOOL_CHOICE_MODE_REQUIRED else "auto"), ""


def _history(chat: pb.Chat, names: set[str], violations: list[FieldViolation]) -> None:
    """Earlier calls name known tools with JSON-object arguments and unique ids; each result answers one."""
    call_ids: set[str] = set()
    for i, message in enumerate(chat.messages):
        where = f"chat.messages[{i}]"
        if message.tool_calls and message.role != "assistant":
            violations.append(FieldViolation(f"{where}.tool_calls", "only assistant messages carry tool calls"))
        for j, call in enumerate(message.tool_calls):
            at = f"{where}.tool_calls[{j}]"
            if call.name not in names:
                violations.append(FieldViolation(f"{at}.name", f"no tool is named {call.name!r} in chat.tools"))
            if not call.id or len(call.id) > MAX_CALL_ID_LENGTH or not printable_ascii(call.id):
                violations.append(FieldViolation(f"{at}.id", f"1 to {MAX_CALL_ID_LENGTH} printable ASCII characters"))
            elif call.id in call_ids:
                violations.append(FieldViolation(f"{at}.id", f"{call.id!r} is used twice"))
            call_ids.add(call.id)
            if not _is_json_object(call.arguments):
                violations.append(FieldViolation(f"{at}.arguments", "must be a JSON object"))
        if message.role == "tool":
            if message.tool_call_id not in call_ids:
                violations.append(FieldViolation(f"{where}.tool_call_id", "answers no earlier tool call"))
        elif message.tool_call_id:
            violations.append(FieldViolation(f"{where}.tool_call_id", "only tool messages answer a call"))


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
