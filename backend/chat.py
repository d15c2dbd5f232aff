"""Chat templates: a model's own Jinja2 template, rendered the way Hugging Face does."""

from __future__ import annotations

from typing import Sequence

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from backend.engine import ChatMessage


class ChatTemplate:
    """Renders messages with one template. Thread-safe: nothing is mutated after construction."""

    def __init__(self, template: str, bos_token: str, eos_token: str) -> None:
        # One formatter per add_generation_prompt value: a formatter's flag is not safe to flip across threads.
        self._formatters = {
            add_prompt: Jinja2ChatFormatter(template, eos_token=eos_token, bos_token=bos_token,
                                            add_generation_prompt=add_prompt)
            for add_prompt in (True, False)
        }

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """Raises on a template error (e.g. a role the template refuses)."""
        turns = [{"role": m.role, "content": m.content} for m in messages]
        return self._formatters[add_generation_prompt](messages=turns).prompt


NO_TEMPLATE = "this model has no chat template; send a prompt instead"
