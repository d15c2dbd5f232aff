"""A chat's turn: its tools, tool choice and reasoning, from the checks to the output.

The rooms, in the order a chat goes through them:
- formats: how this server's model writes tool calls and reasoning (ChatFormats, resolved once)
- plan: what one chat asks for, checked (ToolPlan)
- checks: the chat's fields checked at the edge, made into a ChatTurn (check_chat); its size (chat_bytes)
- render: the messages and template context, the fallback prompt, truncate_input_tokens for a chat
- grammar: the constraint a chat generates under, its parts compiled
- output: the streamed output split into answer text, reasoning and tool calls (ChatOutput)
- turn: ChatTurn, the one object the rest of the service holds (service.validate makes it,
  service.prompt completes it, service.call asks it for its constraint and output parser)
"""

from service.chat.checks import chat_bytes, check_chat
from service.chat.formats import ChatFormats
from service.chat.turn import ChatTurn

__all__ = ["chat_bytes", "ChatFormats", "ChatTurn", "check_chat"]
