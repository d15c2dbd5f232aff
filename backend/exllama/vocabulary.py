"""Prompts, chats and token pieces for the exllama engines, from the model folder's tokenizer.json.

Both generations tokenize with Hugging Face tokenizers too (exllamav2 0.3.2's tokenizer/hf.py wraps
a tokenizers.Tokenizer, exllamav3 1.6.5's Tokenizer holds one), but exllamav2's answers are wrong
for us in two ways, so the engines, and each front end beside an engine in another process, ask
tokenizers and llguidance directly, from the same files (one vocabulary, however it is served):

- Its plain encode (`encode(..., encode_special_tokens=False)`, tokenizer.py:346-366) ends in
  `Tokenizer.encode(text, add_special_tokens=False)` (hf.py:84-86), and tokenizers still turns
  the text of an added special token into that token unless the tokenizer's own
  `encode_special_tokens` flag is set, which exllamav2 never sets: "<|im_start|>" in a chat
  message would forge a turn. Here that flag is set, so text stays text.
- Its id-to-piece list decodes each id alone (hf.py:41-68): a byte-level token holding part of
  a UTF-8 character comes out as U+FFFD. The pieces here are the exact bytes, as llguidance
  reads them from tokenizer.json (its byte-level map or <0xNN> fallback); special tokens are b"".
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import llguidance
import tokenizers

from backend.common.chat import NO_TEMPLATE, ChatTemplate, ChatTemplateError, RenderedChat, SpecialTokens, tokenize_chat
from backend.exllama.model_files import adds_bos, model_config
from backend.types import ChatContext, ChatMessage, ModelInfo


class FolderVocabulary:
    """A model folder's vocabulary (backend.engine.Vocabulary). Thread-safe: read-only after construction."""

    def __init__(
        self,
        tokenizer_json: str,
        ll_tokenizer: llguidance.LLTokenizer,
        bos_token_id: int | None,
        add_bos: bool,
        chat: ChatTemplate | None,
    ) -> None:
        self.ll_tokenizer = ll_tokenizer
        """For the engine's constraint compiler: the same ids and end tokens."""
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._tokenizer.encode_special_tokens = True  # special-token text in the input is text
        self._bos = bos_token_id if add_bos else None
        self._chat = chat
        added = json.loads(tokenizer_json).get("added_tokens") or []
        special = [token for token in added if token.get("special")]
        # The tokens a template's markup may hold, with the whitespace they swallow, as transformers parses them.
        self.specials = SpecialTokens(
            ((token["content"], token["id"]) for token in special),
            lstrip=[token["id"] for token in special if token.get("lstrip")],
            rstrip=[token["id"] for token in special if token.get("rstrip")],
        )
        size = min(self._tokenizer.get_vocab_size(with_added_tokens=True), ll_tokenizer.vocab_size)
        self.pieces = [b"" if ll_tokenizer.is_special_token(t) else ll_tokenizer.decode_bytes([t]) for t in range(size)]

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b""

    token_piece = piece

    def encode_plain(self, text: str) -> list[int]:
        """Ids of text as text: no BOS, and special-token text stays characters."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """A plain prompt: BOS first where the model's tokenizer adds one (and add_special), then the text."""
        ids = self.encode_plain(text)
        return [self._bos, *ids] if add_special and self._bos is not None else ids

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        if self._chat is None:
            raise ChatTemplateError(NO_TEMPLATE)
        if special_tokens_in_content:  # opted into: any special-token text, the callers' too, is a token
            whole = RenderedChat(self._chat.render(messages, add_generation_prompt, context), ())
            return tokenize_chat(whole, (), self.specials, self.encode_plain)
        chat = self._chat.render_marked(messages, add_generation_prompt, context)
        return tokenize_chat(chat, messages, self.specials, self.encode_plain)


def folder_vocabulary(
    model_dir: pathlib.Path, vocab_size: int, bos_token_id: int | None, eos_token_ids: tuple[int, ...]
) -> tuple[FolderVocabulary, str | None]:
    """The vocabulary of an exllama model folder, and its chat template's text (None: it has none): its
    tokenizer.json, tokenizer_config.json's chat template, and the library's word on the vocabulary's
    size, BOS and the end tokens. The special tokens' text is the tokenizer's, by id."""
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    added = {token["id"]: token["content"] for token in json.loads(tokenizer_json).get("added_tokens") or []}
    template = model_config(model_dir, "tokenizer_config.json").get("chat_template")
    bos = added.get(bos_token_id, "") if bos_token_id is not None else ""
    eos = added.get(eos_token_ids[0], "") if eos_token_ids else ""
    chat = ChatTemplate(template, bos, eos) if isinstance(template, str) else None
    vocabulary = FolderVocabulary(tokenizer_json, ll_tokenizer, bos_token_id, adds_bos(model_dir, bos), chat)
    return vocabulary, template if isinstance(template, str) else None


def load_vocabulary(model_dir: pathlib.Path, info: ModelInfo) -> FolderVocabulary:
    """The vocabulary an engine in another process serves, for a front end: from the folder, without the
    library, and the engine's own word on the vocabulary (`info`)."""
    return folder_vocabulary(model_dir, info.vocab_size, info.bos_token_id, info.eos_token_ids)[0]
