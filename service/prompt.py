"""The prompt: tokenize the text, or render the chat, truncate it as asked, and check that it fits.

The one part of building a request that calls the engine (its tokenizer and chat template), after
service.validate has checked the fields. A large input is worked on a worker thread
(`off_loop_if_large`): llama.cpp's tokenizer drops the GIL, and the event loop (health checks
included) must never wait behind a megabyte of text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from backend import ChatContext, ChatMessage, ChatTemplateError, Engine, common_prefix
from service.chat import ChatTurn
from service.chat.render import truncated_chat
from service.errors import FieldViolation, invalid_argument, out_of_range
from service.validate import input_bytes
from tokenspout.v1 import generation_pb2 as pb

# Inputs larger than this are tokenized off the event loop.
_INLINE_TOKENIZE_BYTES = 16_384

T = TypeVar("T")
Request = TypeVar("Request", pb.GenerateStreamRequest, pb.TokenizeRequest)
Render = Callable[[list[ChatMessage]], list[int]]


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    last_message_start: int = 0
    """Where a chat's last message begins in token_ids (0: not known; see GenerationRequest)."""
    truncated_tokens: int = 0
    """How many tokens truncate_input_tokens dropped."""
    turn_end: tuple[int, ...] = ()
    """For a chat: what its template writes after an answer (see GenerationRequest.turn_end)."""
    chat: ChatTurn | None = None
    """A chat's turn, completed: it knows whether its rendering opened reasoning (ChatTurn.prompted)."""


class PromptBuilder:
    def __init__(self, engine: Engine, max_input_bytes: int, special_tokens_in_chat_content: bool = False) -> None:
        self._engine = engine
        self._max_input_bytes = max_input_bytes
        self._special_tokens_in_chat_content = special_tokens_in_chat_content
        self._turn_end: tuple[int, ...] | None = None

    def prompt(self, request: pb.GenerateStreamRequest, max_new_tokens: int, chat: ChatTurn | None = None) -> Prompt:
        """The tokens of a checked request's input, truncated as it asks; for a chat, rendered as its checked turn
        (`chat`, RequestParams.chat) says, which comes back completed.

        Raises INVALID_ARGUMENT (too large, or nothing to generate from) or OUT_OF_RANGE (no room left
        in the context, or more than the engine could ever hold with `max_new_tokens`); a chat template's
        refusal is ChatTemplateError.
        """
        field_name = request.WhichOneof("input") or "text"
        size = input_bytes(request)
        if size > self._max_input_bytes:
            raise invalid_argument([FieldViolation(field_name, f"{size} bytes; at most {self._max_input_bytes}")])
        keep = request.truncate_input_tokens
        if field_name == "chat":
            assert chat is not None, "a chat's turn comes from its checks (RequestParams.chat)"
            messages, context, tokens, truncated = self._chat(request.chat, keep, chat)
        else:
            messages, context = [], ChatContext()
            tokens, truncated = _last(self._text_tokens(request), keep)
        self._check_fits(tokens, field_name)
        problem = self._engine.info.budget_problem(len(tokens), max_new_tokens)
        if problem:
            raise out_of_range("stopping.max_new_tokens", problem)
        start = self._last_message_start(messages, tokens, context)
        if chat is None or field_name != "chat":
            return Prompt(tuple(tokens), start, truncated)
        chat = chat.prompted(b"".join(self._engine.token_piece(t) for t in tokens[-4:]))
        return Prompt(tuple(tokens), start, truncated, self.turn_end(), chat)

    def turn_end(self) -> tuple[int, ...]:
        """The tokens the chat template writes after an answer, up to where the next message begins, found
        once from a sample exchange (none when the template shows no such ending)."""
        if self._turn_end is None:
            self._turn_end = ()
            asked, answer = [ChatMessage("user", "Hi")], "Hello"
            try:
                prompt = self._engine.render_chat(asked, True)
                answered = self._engine.render_chat([*asked, ChatMessage("assistant", answer)], False)
            except ChatTemplateError:
                return self._turn_end
            written = [*prompt, *self._engine.tokenize(answer, add_special=False)]
            if answered[: len(written)] == written:
                self._turn_end = tuple(answered[len(written) :])
        return self._turn_end

    def chat_tokens(self, chat: pb.Chat, turn: ChatTurn) -> list[int]:
        """A chat's tokens as the template renders it (its turn checked), whole, tools included (Tokenize)."""
        messages, context = turn.render(chat)
        return self._renderer(chat, context)(messages)

    def tokenize_texts(self, request: pb.TokenizeRequest) -> list[tuple[bytes, list[int]]]:
        """Each text of a checked Tokenize call (`texts`, else its one text) as UTF-8 with its tokens."""
        texts = list(request.texts)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return [
            (data, self._engine.tokenize(text, add_special=add_special))
            for text, data in ((text, text.encode()) for text in (texts or [request.text]))
        ]

    def _text_tokens(self, request: pb.GenerateStreamRequest) -> list[int]:
        if request.HasField("prompt_token_ids"):
            return list(request.prompt_token_ids.ids)  # as given: the caller decides on BOS
        return self._engine.tokenize(request.prompt, add_special=True)

    def _chat(self, chat: pb.Chat, keep: int, turn: ChatTurn) -> tuple[list[ChatMessage], ChatContext, list[int], int]:
        """The messages kept, their tokens, and how many tokens dropping the others saved (see service.chat.render)."""
        messages, context = turn.render(chat)
        render = self._renderer(chat, context)
        tokens = render(messages)
        if not keep or len(tokens) <= keep:
            return messages, context, tokens, 0
        kept, kept_tokens = truncated_chat(messages, tokens, keep, render)
        return kept, context, kept_tokens, len(tokens) - len(kept_tokens)

    def _renderer(self, chat: pb.Chat, context: ChatContext) -> Render:
        """Renders messages as this chat asks; the template refusing them is the caller's input (ChatTemplateError)."""
        add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return lambda kept: self._engine.render_chat(kept, add_prompt, self._special_tokens_in_chat_content, context)

    def _check_fits(self, tokens: list[int], field_name: str) -> None:
        if not tokens:
            raise invalid_argument([FieldViolation(field_name, "tokenizes to nothing")])
        limit = self._engine.info.context_length
        if len(tokens) >= limit:
            raise out_of_range(field_name, f"{len(tokens)} prompt tokens leave no room in the {limit}-token context")

    def _last_message_start(self, messages: list[ChatMessage], prompt: list[int], context: ChatContext) -> int:
        """Where a chat's last message begins in its tokens: the history before it renders to their prefix."""
        if len(messages) < 2:
            return 0
        history = messages[:-1]
        try:
            before = self._engine.render_chat(history, False, self._special_tokens_in_chat_content, context)
        except ChatTemplateError:  # a template may refuse a history on its own (e.g. ending with the system)
            return 0
        return common_prefix(before, prompt)


async def off_loop_if_large(work: Callable[[Request], T], request: Request) -> T:
    """Runs tokenizing work on a worker thread when the input is large, so the loop never stalls."""
    if input_bytes(request) > _INLINE_TOKENIZE_BYTES:
        return await asyncio.to_thread(work, request)
    return work(request)


def _last(tokens: list[int], keep: int) -> tuple[list[int], int]:
    """A prompt's last `keep` tokens (0: all of them), and how many it dropped."""
    if keep and len(tokens) > keep:
        return tokens[-keep:], len(tokens) - keep
    return tokens, 0
