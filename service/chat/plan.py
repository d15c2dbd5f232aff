"""What one chat asks for, checked (service.chat.checks makes it): its tools, tool choice and reasoning."""

from __future__ import annotations

from dataclasses import dataclass

from backend.tools import ToolSchema
from tokenspout.v1 import generation_pb2 as pb


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
        """The tools as Hugging Face templates take them (and as the fallback prompt lists them)."""
        return tuple(
            {"type": "function", "function": {"name": t.name, "description": d, "parameters": _shown(t.parameters)}}
            for t, d in zip(self.tools, self.descriptions, strict=True)
        )


def _shown(parameters: dict[str, object] | bool) -> dict[str, object]:
    return parameters if isinstance(parameters, dict) else {"type": "object"}
