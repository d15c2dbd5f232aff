"""Chat templates: a model's own Jinja2 template, rendered the way Hugging Face renders it.

Jinja2 directly rather than llama.cpp's formatter, so the exllamav2 engine needs no
llama.cpp installed. The settings follow transformers' chat-template renderer: a sandbox,
trimmed blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` that keeps
non-ASCII text as is.

Only the template's own markup may hold special tokens: a message that contains
"<|im_end|>" means those characters, not the token, or any caller could forge a
system turn. `render_marked` finds where each message's content lies in the
rendered text, and `tokenize_chat` turns special-token text into tokens outside
those spans only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.types import ChatContext, ChatMessage

NO_TEMPLATE = "this model has no chat template; send a prompt instead"


class ChatTemplateError(ValueError):
    """The template refused the messages (or there is none): the caller's input problem."""


CONTENT_REWRITTEN = (
    "a chat message contains special-token text, and this model's chat template rewrites message content, "
    "so it cannot be kept as plain text; remove the special tokens from the message"
)


@dataclass(frozen=True)
class RenderedChat:
    text: str
    content_spans: tuple[tuple[int, int], ...] | None
    """Where message content lies in `text`, in order; None when the template rewrote content."""


class SpecialTokens:
    """The special tokens a template's markup may hold, found by their text (longest first, as llama.cpp does)."""

    def __init__(
        self, tokens: Iterable[tuple[str, int]], lstrip: Iterable[int] = (), rstrip: Iterable[int] = ()
    ) -> None:
        self.ids = {text: token for text, token in tokens if text}
        by_length = sorted(self.ids, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        # Tokens that swallow the whitespace before / after them (a tokenizer's lstrip / rstrip flags).
        self.lstrip = frozenset(lstrip)
        self.rstrip = frozenset(rstrip)

    def occur_in(self, text: str) -> bool:
        return self.pattern is not None and self.pattern.search(text) is not None

    def find(self, text: str, start: int, end: int) -> list[tuple[int, int, int]]:
        """(start, end, token id) of each special token's text within text[start:end]."""
        if self.pattern is None:
            return []
        return [(m.start(), m.end(), self.ids[m.group()]) for m in self.pattern.finditer(text, start, end)]


_WHITESPACE = " \t\n\r\v\f"


def tokenize_chat(
    chat: RenderedChat,
    messages: Sequence[ChatMessage],
    specials: SpecialTokens,
    encode_plain: Callable[[str], list[int]],
) -> list[int]:
    """Tokens for a rendered chat: special-token text in the markup becomes special tokens; the
    text between them, message content included, is encoded as plain text (no BOS added)."""
    spans = chat.content_spans
    if spans is None:
        if any(specials.occur_in(m.content) for m in messages):
            raise ChatTemplateError(CONTENT_REWRITTEN)
        spans = ()  # nothing in the content could become a special token
    text = chat.text
    found: list[tuple[int, int, int]] = []
    markup_start = 0
    for content_start, content_end in (*spans, (len(text), len(text))):
        found += specials.find(text, markup_start, content_start)
        markup_start = content_end
    tokens: list[int] = []
    at, strip_start = 0, False
    for start, end, token in (*found, (len(text), len(text), None)):
        piece = text[at:start]
        if strip_start:
            piece = piece.lstrip(_WHITESPACE)
        if token in specials.lstrip:
            piece = piece.rstrip(_WHITESPACE)
        if piece:
            tokens += encode_plain(piece)
        if token is not None:
            tokens.append(token)
        strip_start, at = token in specials.rstrip, end
    return tokens


class _GenerationTag(jinja2.ext.Extension):
    """Passes through `{% generation %}` blocks, which only mark assistant text for training."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """Renders messages with one template. Thread-safe: nothing is mutated after construction."""

    def __init__(self, template: str, bos_token: str, eos_token: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals.update(
            raise_exception=_raise_exception,
            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
        )
        self._template = environment.from_string(template)
        # Templates test `tools is not none` and the like: transformers defines them as None.
        self._context = {"bos_token": bos_token, "eos_token": eos_token, "tools": None, "documents": None}

    def render_marked(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, context: ChatContext = ChatContext()
    ) -> RenderedChat:
        """The rendered text and where each message's content lies in it.

        Renders twice: as is, and with each content between random markers no caller can
        guess. Where the markers sit is the content, provided that removing them gives the
        same text, i.e. the template copied content verbatim.
        """
        text = self.render(messages, add_generation_prompt, context)
        nonce = secrets.token_hex(8)
        opening, closing = f"\ue000{nonce}<", f">{nonce}\ue000"
        marked_messages = [dataclasses.replace(m, content=opening + m.content + closing) for m in messages]
        try:
            marked = self.render(marked_messages, add_generation_prompt, context)
        except ChatTemplateError:
            return RenderedChat(text, None)
        first, *rest = marked.split(opening)
        plain, spans, length = [first], [], len(first)
        for piece in rest:
            content, found, after = piece.partition(closing)
            if not found or closing in after:
                return RenderedChat(text, None)
            spans.append((length, length + len(content)))
            plain += (content, after)
            length += len(content) + len(after)
        if closing in first or "".join(plain) != text:
            return RenderedChat(text, None)
        return RenderedChat(text, tuple(spans))

    def render(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, context: ChatContext = ChatContext()
    ) -> str:
        """Raises ChatTemplateError when the template fails (e.g. on a role it refuses)."""
        turns = [_turn(m) for m in messages]
        extra: dict[str, object] = {}
        if context.tools is not None:
            extra["tools"] = list(context.tools)
        if context.enable_thinking is not None:
            extra["enable_thinking"] = context.enable_thinking
        try:
            return self._template.render(
                messages=turns, add_generation_prompt=add_generation_prompt, **{**self._context, **extra}
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None


def _turn(message: ChatMessage) -> dict[str, object]:
    """A message as Hugging Face templates read it (OpenAI's shape for tool calls, arguments as an object)."""
    turn: dict[str, object] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": _arguments(call.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.reasoning:
        turn["reasoning_content"] = message.reasoning
    return turn


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # checked by the service; a template still gets something to print
        return text
