"""Chat templates render exactly as llama.cpp's reference formatter renders them."""

from __future__ import annotations

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from backend.common.chat import ChatTemplate
from backend.types import ChatMessage

CONVERSATIONS = [
    [ChatMessage("user", "Hi")],
    [ChatMessage("system", "Be brief."), ChatMessage("user", "Naïve café? «ok»"), ChatMessage("assistant", "Yes.")],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_models_template_renders_like_the_reference(model, messages, add_generation_prompt):
    ours = ChatTemplate(model.chat_template, "<s>", "</s>").render(messages, add_generation_prompt)
    reference = Jinja2ChatFormatter(
        model.chat_template, eos_token="</s>", bos_token="<s>", add_generation_prompt=add_generation_prompt
    )(messages=[{"role": m.role, "content": m.content} for m in messages]).prompt
    assert ours == reference
    assert all(m.content in ours for m in messages)


def test_template_helpers_and_errors():
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% if loop.index == 2 %}{% break %}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}>{% endif %}",
        "<s>",
        "</s>",
    )
    three = [ChatMessage("user", "é"), ChatMessage("assistant", "b"), ChatMessage("user", "c")]
    assert template.render(three) == '<s>"é""b">'
    with pytest.raises(ValueError, match="no tools"):
        template.render([ChatMessage("tool", "x")])


def test_tools_and_documents_are_defined_as_none():
    template = ChatTemplate(
        "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
        "{{ messages[0].content }}",
        "<s>",
        "</s>",
    )
    assert template.render([ChatMessage("user", "hi")]) == "hi"
