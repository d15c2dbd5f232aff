"""How model families write tool calls and reasoning: the markers around them and the JSON inside.

One `ToolFormat` per family. The streaming parser (backend.tools.parser) reads output with it, the
grammar builder (backend.tools.grammar) enforces it, and `detect_format` picks one from a chat
template's own markup, so a Qwen or Hermes GGUF needs no setting.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    """As GetModelInfo.tool_call_format and the tool_call_format setting spell it."""
    start: str
    """The marker that opens a call ("" where a bare JSON object at the start of the turn opens one)."""
    end: str
    """The marker that closes a call ("" where the JSON's own closing brace ends it)."""
    arguments_key: str
    """The JSON key holding the arguments object."""
    array: bool = False
    """The marker opens a JSON array of calls (Mistral) rather than one object per marker."""
    bare_json: bool = False
    """A call may also be a bare JSON object {"name": ...} at the start of the turn (Llama 3.x)."""

    def render_call(self, name: str, arguments: str) -> str:
        """One call as the model writes it (for the fallback prompt's example and for tests)."""
        body = f'{{"name": "{name}", "{self.arguments_key}": {arguments}}}'
        if self.array:
            return f"{self.start}[{body}]"
        return f"{self.start}{body}{self.end}" if self.start else body


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", "", "parameters", bare_json=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", array=True)

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
"""Every format by name, for the setting and GetModelInfo."""

FALLBACK_FORMAT = HERMES
"""What the fallback prompt teaches a model whose template does not know tools."""


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str


THINK = ReasoningFormat("think", "<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {THINK.name: THINK}


def detect_format(template: str) -> ToolFormat | None:
    """The format a chat template writes calls in, from its markup; None when it does not render tools."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return LLAMA3_JSON
    return None


def detect_reasoning(template: str) -> ReasoningFormat | None:
    """Reasoning markup the template knows (Qwen3, DeepSeek-R1 and their kin use <think>)."""
    return THINK if THINK.end in template else None
