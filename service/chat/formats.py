"""How this server's model writes tool calls and reasoning: resolved once, from the model and two settings."""

from __future__ import annotations

from dataclasses import dataclass

from backend import ModelInfo
from backend.tools import FALLBACK_FORMAT, FORMATS, REASONING_FORMATS, THINK, ReasoningFormat, ToolFormat


@dataclass(frozen=True)
class ChatFormats:
    """How this server's model writes tool calls and reasoning."""

    tools: ToolFormat | None
    template_renders_tools: bool
    reasoning: ReasoningFormat | None

    @classmethod
    def resolve(cls, info: ModelInfo, tool_setting: str = "auto", reasoning_setting: str = "auto") -> ChatFormats:
        """The formats for the tool_call_format and reasoning_format settings (their defaults, "auto", here alone):
        "auto" takes the template's own (else the fallback prompt's format, or <think>); "none" turns it off."""
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
