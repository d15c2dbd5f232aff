"""A chat rendered: its messages and template context, and truncate_input_tokens for it.

The server's formats (service.chat.formats) decide how tools are shown. A template that renders
`tools` gets them as Hugging Face passes them; otherwise the fallback prompt (`fallback_messages`)
describes the tools in a system message and writes earlier calls and results in the fallback
format's markup.

A prompt keeps its last N tokens (see service.prompt); a chat cut mid-message would lose its
template's markup, so it loses whole messages instead (`truncated_chat`), never the system message
nor the last. Fewer messages render to fewer tokens, so the fewest to drop is found by bisection: a
few renders, not one per message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from backend import ChatContext, ChatMessage
from backend.tools import ToolCall, ToolFormat
from service.chat.formats import ChatFormats
from service.chat.plan import ToolPlan
from tokenspout.v1 import generation_pb2 as pb


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


def truncated_chat(
    messages: Sequence[ChatMessage], tokens: list[int], keep: int, render: Callable[[list[ChatMessage]], list[int]]
) -> tuple[list[ChatMessage], list[int]]:
    """The messages left, and their tokens, after dropping the fewest oldest messages that bring the chat to
    at most `keep` tokens. A leading system message and the last message always stay, so the result may
    still be longer than `keep`."""
    head = list(messages[:1]) if messages and messages[0].role == "system" else []
    droppable = len(messages) - len(head) - 1  # the messages between the system message and the last
    if len(tokens) <= keep or droppable <= 0:
        return list(messages), tokens

    def without(dropped: int) -> list[ChatMessage]:
        return [*head, *messages[len(head) + dropped:]]

    rendered = {0: tokens}
    low, high = 0, droppable  # dropping `low` is too long; is dropping `high` short enough?
    rendered[high] = render(without(high))
    if len(rendered[high]) > keep:
        return without(high), rendered[high]
    while high - low > 1:
        middle = (low + high) // 2
        rendered[middle] = render(without(middle))
        if len(rendered[middle]) <= keep:
            high = middle
        else:
            low = middle
    return without(high), rendered[high]
