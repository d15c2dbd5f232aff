"""A chat's streamed output split into answer text, reasoning and tool calls, message by message.

One `ChatOutput` per sample: each outgoing message's text goes through the sample's parser
(backend.tools.parser), which holds back what could still be markup, so `text` never carries it;
the last message takes what was held, counts the reasoning tokens, and finishes with
FINISH_REASON_TOOL_CALLS when the turn ended after calls.
"""

from __future__ import annotations

from collections.abc import Sequence

from backend import TokenEvent
from backend.tools import OutputParser, Parsed
from service.chat.formats import ChatFormats
from service.chat.plan import ToolPlan
from tokenspout.v1 import generation_pb2 as pb

# The turn ended by itself (not cut short) after its calls: the caller's move.
_ENDED = (pb.FINISH_REASON_EOS_TOKEN, pb.FINISH_REASON_CONSTRAINT_COMPLETE, pb.FINISH_REASON_STOP_TOKEN)


def wants_parsing(formats: ChatFormats, plan: ToolPlan) -> bool:
    """A chat's output holds what is parsed out of it: reasoning (when the server parses it), or tool calls."""
    return formats.reasoning is not None or (plan.calls_parsed and formats.tools is not None)


class ChatOutput:
    """One sample's output parser: `rewrite` each of its messages in order (service.samples)."""

    def __init__(self, formats: ChatFormats, plan: ToolPlan, in_reasoning: bool, caller_constraint: bool) -> None:
        self._caller_constraint = caller_constraint
        tools = formats.tools if plan.calls_parsed else None
        names = frozenset(tool.name for tool in plan.tools)
        self._parser = OutputParser(tools, formats.reasoning, names, in_reasoning)
        self._generated = 0
        self._held_tokens = 0
        self.reasoning_tokens = 0

    def rewrite(self, message: pb.GenerateStreamResponse, events: Sequence[TokenEvent]) -> None:
        """Replaces the message's text (its events' texts) with its answer part and fills reasoning and the
        tool calls; an event's tokens count as reasoning when its text was in or entered a reasoning block."""
        parsed = Parsed()
        for event in events:
            was_reasoning = self._parser.in_reasoning
            part = self._parser.push(event.text)
            tokens = event.generated_tokens - self._generated
            self._generated = event.generated_tokens
            if was_reasoning or self._parser.in_reasoning or part.reasoning:
                # The start marker's tokens were held back as possible markup before it completed.
                self.reasoning_tokens += tokens + (0 if was_reasoning else self._held_tokens)
                self._held_tokens = 0
            elif part:
                self._held_tokens = 0
            else:
                self._held_tokens += tokens
            _merge(parsed, part)
        finish = message.finish if message.HasField("finish") else None
        if finish is not None:
            _merge(parsed, self._parser.finish())
        message.text = parsed.text
        message.reasoning = parsed.reasoning
        message.tool_call_deltas.extend(
            pb.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments_delta=d.arguments) for d in parsed.deltas
        )
        message.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parsed.calls)
        if finish is not None:
            finish.usage.reasoning_tokens = self.reasoning_tokens
            if not self._caller_constraint:  # the grammar was the server's own (tools, reasoning), not the caller's
                finish.ClearField("constraint_satisfied")
                finish.constraint_message = ""
                if finish.reason == pb.FINISH_REASON_CONSTRAINT_COMPLETE:
                    finish.reason = pb.FINISH_REASON_EOS_TOKEN  # the answer ended; there was no constraint to complete
            if self._parser.calls and finish.reason in _ENDED:
                finish.reason = pb.FINISH_REASON_TOOL_CALLS


def _merge(into: Parsed, more: Parsed) -> None:
    into.text += more.text
    into.reasoning += more.reasoning
    into.deltas += more.deltas
    into.calls += more.calls
