"""truncate_input_tokens for a chat: drop whole messages, oldest first, never the system message nor the last.

A prompt keeps its last N tokens (see service.prompt); a chat cut mid-message would
lose its template's markup, so it loses whole messages instead. Fewer messages render to
fewer tokens, so the fewest to drop is found by bisection: a few renders, not one per message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backend import ChatMessage


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
