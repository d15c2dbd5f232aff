"""One chat's turn, from its checks to its last message: the one object the rest of the service holds.

    turn = check_chat(chat, formats, constraint, limit, violations)  # service.validate: what the chat asks
    messages, context = turn.render(chat)                           # service.prompt: what the template renders
    turn = turn.prompted(prompt_tail)                               # ... and whether that opened reasoning
    spec = await turn.constraint(compiles)                          # service.call: what it generates under
    parser = turn.output_parser()                                   # ... and how its output is read

Frozen: the prompt's fact comes back as a new turn (Prompt.chat), so no copy of it goes stale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend import ChatContext, ChatMessage
from backend.constraints import ConstraintSpec
from service.chat.formats import ChatFormats
from service.chat.grammar import chat_constraint
from service.chat.output import ChatOutput, wants_parsing
from service.chat.plan import ToolPlan
from service.chat.render import chat_messages
from service.compiles import CompileGate
from tokenspout.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class ChatTurn:
    """A chat's tools, choice and reasoning (`plan`), how this server's model writes them (`formats`), the
    caller's constraint, and once its prompt is built, whether the template opened reasoning for the model."""

    formats: ChatFormats
    plan: ToolPlan = ToolPlan()
    caller_constraint: ConstraintSpec | None = None
    """The caller's own constraint (checked by service.validate); the answer follows it after any reasoning."""
    reasoning_opened: bool | None = None
    """The rendered prompt ends inside a reasoning block; None until the prompt is built (`prompted`)."""

    def render(self, chat: pb.Chat) -> tuple[list[ChatMessage], ChatContext]:
        """The messages and template context to render this chat with (service.chat.render)."""
        return chat_messages(chat, self.plan, self.formats)

    def prompted(self, prompt_tail: bytes) -> ChatTurn:
        """This turn, its prompt built: `prompt_tail` is the rendered prompt's last few tokens' bytes."""
        reasoning = self.formats.reasoning
        opened = reasoning is not None and prompt_tail.rstrip().endswith(reasoning.start.encode())
        return ChatTurn(self.formats, self.plan, self.caller_constraint, opened)

    async def constraint(self, compiles: CompileGate) -> ConstraintSpec | None:
        """What the turn generates under: the caller's constraint as is, or the grammar of its tools and
        reasoning, compiled (service.chat.grammar). Raises INVALID_ARGUMENT naming what cannot be enforced."""
        return await chat_constraint(self.plan, self.formats, self.caller_constraint, self._opened(), compiles)

    def output_parser(self) -> Callable[[], ChatOutput] | None:
        """Makes each sample's output parser, when the output holds reasoning or tool calls to parse."""
        if not wants_parsing(self.formats, self.plan):
            return None
        formats, plan, caller_constraint = self.formats, self.plan, self.caller_constraint is not None
        in_reasoning = self._opened() and plan.reasoning_mode != pb.REASONING_MODE_OFF
        return lambda: ChatOutput(formats, plan, in_reasoning, caller_constraint)

    def _opened(self) -> bool:
        assert self.reasoning_opened is not None, "the prompt comes first (prompted)"
        return self.reasoning_opened
