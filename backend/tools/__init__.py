"""Tool calls and reasoning: the markup of each model family, parsing it out of streamed output,
the fallback prompt for templates that do not know tools, and the grammar that enforces calls."""

from backend.tools.formats import (
    FALLBACK_FORMAT,
    FORMATS,
    REASONING_FORMATS,
    THINK,
    ReasoningFormat,
    ToolFormat,
    detect_format,
    detect_reasoning,
)
from backend.tools.grammar import GrammarBuilder, ReasoningRule, ToolSchema
from backend.tools.parser import CallDelta, OutputParser, Parsed, ToolCall, new_call_id

__all__ = [
    "CallDelta",
    "detect_format",
    "detect_reasoning",
    "FALLBACK_FORMAT",
    "FORMATS",
    "GrammarBuilder",
    "new_call_id",
    "OutputParser",
    "Parsed",
    "REASONING_FORMATS",
    "ReasoningFormat",
    "ReasoningRule",
    "THINK",
    "ToolCall",
    "ToolFormat",
    "ToolSchema",
]
