"""The llguidance grammar that enforces tool calls and reasoning, as one composed constraint.

    [reasoning]  "<think>" THOUGHT "</think>"  (the opener left out when the prompt already holds it)
    answer       a caller's constraint, forced tool calls (required / a named tool), lazily
                 enforced calls in free text (auto), or free text

THOUGHT stops at the end marker or after the reasoning budget, when the grammar then forces the
marker. Tool arguments are inline %json sub-grammars, so a call's arguments match its tool's schema.
Markers that are special tokens in the vocabulary are written as tokens (<tool_call>), since
llguidance never produces a special token from text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backend.tools.formats import ReasoningFormat, ToolFormat


@dataclass(frozen=True)
class ToolSchema:
    name: str
    parameters: dict[str, object] | bool
    """The arguments' JSON Schema (True: any object)."""


@dataclass(frozen=True)
class ReasoningRule:
    format: ReasoningFormat
    opened: bool
    """The prompt already ends with the start marker (the template opened the block)."""
    budget_tokens: int = 0
    """0: no budget."""


_FREE_TEXT = r"/(.|\n)*/"


class GrammarBuilder:
    """Builds grammars for one vocabulary: `is_special` says whether a marker is one special token."""

    def __init__(self, is_special: Callable[[str], bool]) -> None:
        self._is_special = is_special

    def marker(self, text: str) -> str:
        return text if self._is_special(text) else json.dumps(text)

    def compose(
        self,
        reasoning: ReasoningRule | None,
        answer_rules: str,
        sub_grammars: Sequence[dict[str, object]] = (),
    ) -> str:
        """The whole grammar (llguidance's JSON form) from the answer's Lark rules (rule `answer`)."""
        lines = ["%llguidance {}"]
        if reasoning is None:
            lines.append("start: answer")
        else:
            opener = "" if reasoning.opened else self.marker(reasoning.format.start) + " "
            limit = f", max_tokens={reasoning.budget_tokens}" if reasoning.budget_tokens else ""
            end = reasoning.format.end
            lines.append(f"start: {opener}thought {self.marker(end)} GAP answer")
            lines.append(f"thought[stop={json.dumps(end)}{limit}]: {_FREE_TEXT}")
            lines.append(r"GAP: /[ \n]{0,2}/")
        lines.append(answer_rules)
        grammars: list[dict[str, object]] = [{"name": "main", "lark_grammar": "\n".join(lines) + "\n"}]
        grammars += sub_grammars
        return json.dumps({"grammars": grammars})

    def free_answer(self) -> str:
        return f"answer: {_FREE_TEXT}"

    def constraint_answer(self, constraint_grammar: str) -> tuple[str, list[dict[str, object]]]:
        """A caller's compiled-to-text constraint (backend.constraints.compiler.to_grammar) as the answer."""
        if constraint_grammar.lstrip().startswith("{"):
            subs = json.loads(constraint_grammar)["grammars"]
        else:
            subs = [{"lark_grammar": constraint_grammar}]
        subs[0] = {**subs[0], "name": "constraint"}
        return "answer: @constraint", subs

    def tool_answer(self, fmt: ToolFormat, tools: Sequence[ToolSchema], forced: bool, parallel: bool) -> str:
        """Calls to `tools`: forced from the first token, or (auto) enforced once the call's marker appears."""
        call_json = "%json " + json.dumps(_call_schema(fmt, tools))
        start = self.marker(fmt.start)
        if fmt.array:
            more = f' ("," {call_json})*' if parallel else ""
            body = f'"[" {call_json}{more} "]"'
        elif fmt.end:
            body = f'"\\n" {call_json} "\\n" {self.marker(fmt.end)}'
        else:
            body = call_json
        if forced:
            if fmt.array:
                return f"answer: {start} {body}"
            repeat = ' ("\\n" call)*' if parallel else ""
            return f"answer: call{repeat}\ncall: {start} {body}"
        rules = [f"TAIL: {_FREE_TEXT}"]
        if self._is_special(fmt.start):  # a special token never occurs in free text: no lazy lexeme needed
            rules.append(f"call: TAIL {start} {body}")
        else:
            rules.append(f"call_trigger[lazy]: TAIL {start}")
            rules.append(f"call: call_trigger {body}")
        calls = "call*" if parallel else "call?"
        return "\n".join([f"answer: {calls} TAIL", *rules])


def _call_schema(fmt: ToolFormat, tools: Sequence[ToolSchema]) -> dict[str, object]:
    """One call's JSON: {"name": <a tool's name>, "<arguments key>": <that tool's arguments>}, compact."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                fmt.arguments_key: _arguments_schema(tool.parameters),
            },
            "required": ["name", fmt.arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, object] = options[0] if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False}
    return schema


def _arguments_schema(parameters: dict[str, object] | bool) -> dict[str, object] | bool:
    """Without its own additionalProperties, a schema with properties allows only those (OpenAI's strict
    mode does the same): otherwise a small model can add keys until max_new_tokens."""
    if parameters is True or parameters == {}:
        return {"type": "object"}
    if isinstance(parameters, dict) and "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters
