"""Chat templates: a model's own Jinja2 template, rendered the way Hugging Face renders it.

Jinja2 directly rather than llama.cpp's formatter, so the exllamav2 engine needs no
llama.cpp installed. The settings follow transformers' chat-template renderer: a sandbox,
trimmed blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` that keeps
non-ASCII text as is.
"""

from __future__ import annotations

import datetime
import json
from typing import Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.engine import ChatMessage

NO_TEMPLATE = "this model has no chat template; send a prompt instead"


class _GenerationTag(jinja2.ext.Extension):
    """Passes through `{% generation %}` blocks, which only mark assistant text for training."""

    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise ValueError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
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

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """Raises on a template error (e.g. a role the template refuses)."""
        turns = [{"role": m.role, "content": m.content} for m in messages]
        return self._template.render(messages=turns, add_generation_prompt=add_generation_prompt, **self._context)
