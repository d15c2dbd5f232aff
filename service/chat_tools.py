"""A chat's tools, tool choice and reasoning: checked, rendered into messages, and made into a grammar.

The server's formats (`ChatFormats`) come from the model's template or the tool_call_format and
reasoning_format settings. A template that renders `tools` gets them as Hugging Face passes them;
otherwise the fallback prompt (`fallback_messages`) describes the tools in a system message and
writes earlier calls and results in the fallback format's markup. The grammar (backend.tools.grammar)
is built here when the request needs one: forced or auto calls, reasoning on or with a budget, or
a caller's constraint that must start after the reasoning.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from backend import ChatContext, ChatMessage, ModelInfo
from backend.constraints import MAX_JSON_DEPTH, ConstraintSpec, json_depth, to_grammar
from backend.tools import (
    FALLBACK_FORMAT,
    FORMATS,
    REASONING_FORMATS,
    THINK,
    GrammarBuilder,
    ReasoningFormat,
    ReasoningRule,
    ToolCall,
    ToolFormat,
    ToolSchema,
)
from service.errors import FieldViolation
from service.fields import printable_ascii
from tokenspout.v1 import generation_pb2 as pb

MAX_TOOLS = 128
MAX_CALL_ID_LENGTH = 64
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
COMPOSED = "composed"
"""The ConstraintSpec kind of a grammar built here (backend.constraints.compiler takes it as is)."""


@dataclass(frozen=True)
class ChatFormats:
    """How this server's model writes tool calls and reasoning."""

    tools: ToolFormat | None
    template_renders_tools: bool
    reasoning: ReasoningFormat | None

    @classmethod
    def resolve(cls, info: ModelInfo, tool_setting: str, reasoning_setting: str) -> ChatFormats:
        """"auto" takes the template's own (else the fallback prompt's format, or <think>); "none" turns it off."""
        template_tools = FORMATS.get(info.template_tool_format)
        if not info.has_chat_template or tool_setting == "none":
            tools = None
        elif tool_setting == "auto":
            tools = template_tools or FALLBACK_FORMAT
        else:
            tools = FORMATS[tool_setting]
        if reasoning_setting == "none":
            reasoning = None
        elif reasoning_setting == "auto":
            reasoning = REASONING_FORMATS.get(info.template_reasoning_format, THINK)
        else:
            reasoning = REASONING_FORMATS[reasoning_setting]
        renders = tools is not None and template_tools is tools
        return cls(tools, renders, reasoning)


@dataclass(frozen=True)
class ToolPlan:
    """What one chat asks for, checked."""

    tools: tuple[ToolSchema, ...] = ()
    descriptions: tuple[str, ...] = ()
    choice: str = "none"
    """none, auto, required or named."""
    named: str = ""
    parallel: bool = True
    reasoning_mode: int = pb.REASONING_MODE_UNSPECIFIED
    budget_tokens: int = 0

    @property
    def calls_parsed(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> tuple[dict[str, object], ...]:
        return tuple(
            {"type": "function", "function": {"name": t.name, "description": d, "parameters": _shown(t.parameters)}}
            for t, d in zip(self.tools, self.descriptions, strict=True)
        )


def check_chat(chat: pb.Chat, formats: ChatFormats, max_schema_chars: int, violations: list[FieldViolation]) -> ToolPlan:
    """The chat's tools, choice, history and reasoning, each problem added to `violations`."""
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
    return ToolPlan(tuple(tools), tuple(descriptions), choice, named, parallel, mode, budget)


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


def _shown(parameters: dict[str, object] | bool) -> dict[str, object]:
    return parameters if isinstance(parameters, dict) else {"type": "object"}


def chat_messages(chat: pb.Chat, plan: ToolPlan, formats: ChatFormats) -> tuple[list[ChatMessage], ChatContext]:
    """The messages and template context to render: the tools given to a template that takes them,
    else described by the fallback prompt (and left out when tool_choice is none)."""
    messages = [
        ChatMessage(m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                    m.tool_call_id, m.reasoning)
        for m in chat.messages
    ]
    thinking = None if plan.reasoning_mode == pb.REASONING_MODE_UNSPECIFIED else plan.reasoning_mode == pb.REASONING_MODE_ON
    if formats.tools is None or (not plan.tools and not any(m.tool_calls for m in messages)):
        return messages, ChatContext(enable_thinking=thinking)
    shown = plan.template_tools() if plan.calls_parsed else ()
    if formats.template_renders_tools:
        return messages, ChatContext(tools=shown or None, enable_thinking=thinking)
    return fallback_messages(messages, shown, formats.tools), ChatContext(enable_thinking=thinking)


def fallback_messages(
    messages: list[ChatMessage], tools: tuple[dict[str, object], ...], fmt: ToolFormat
) -> list[ChatMessage]:
    """For a template that knows no tools: a system prompt listing them, earlier calls written as the
    format's markup in the assistant's content, and results as user messages in <tool_response> tags."""
    out: list[ChatMessage] = []
    for m in messages:
        if m.tool_calls:
            calls = "\n".join(fmt.render_call(c.name, c.arguments) for c in m.tool_calls)
            out.append(ChatMessage(m.role, f"{m.content}\n{calls}" if m.content else calls))
        elif m.role == "tool":
            out.append(ChatMessage("user", f"<tool_response>\n{m.content}\n</tool_response>"))
        else:
            out.append(ChatMessage(m.role, m.content))
    if not tools:
        return out
    prompt = fallback_prompt(tools, fmt)
    if out and out[0].role == "system":
        return [ChatMessage("system", f"{out[0].content}\n\n{prompt}"), *out[1:]]
    return [ChatMessage("system", prompt), *out]


def fallback_prompt(tools: tuple[dict[str, object], ...], fmt: ToolFormat) -> str:
    """The documented fallback prompt (docs/api.md, "Tool calls"): Hermes' wording, which small models know."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = fmt.render_call("<function-name>", "<arguments-json-object>")
    return (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within these tags:\n"
        f"{example}"
    )


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


def reasoning_opened(formats: ChatFormats, prompt_tail: bytes) -> bool:
    """The rendered prompt ends inside a reasoning block (the template opened it for the model)."""
    return formats.reasoning is not None and prompt_tail.rstrip().endswith(formats.reasoning.start.encode())
