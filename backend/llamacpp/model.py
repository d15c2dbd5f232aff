"""A loaded GGUF model: weights, vocabulary, tokenizer and chat template.

Everything here is read-only after loading, so tokenizing from the event loop
while the engine thread decodes is safe.
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
from collections.abc import Sequence

import llama_cpp
import llguidance
import numpy as np

from backend.common.chat import NO_TEMPLATE, ChatTemplate, ChatTemplateError, SpecialTokens, tokenize_chat
from backend.common.models import ModelError
from backend.constraints import build_tokenizer
from backend.types import ChatContext, ChatMessage

log = logging.getLogger(__name__)

_LOG_LEVEL_ERROR = 4  # GGML_LOG_LEVEL_ERROR


_load_errors: list[str] | None = None
"""While a model loads: llama.cpp's errors, for the one line that says why it could not."""


def _log_to_python(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp is chatty on stderr; keep only its errors, through Python logging.
    if level == _LOG_LEVEL_ERROR:
        message = text.decode("utf-8", "replace").rstrip()
        if _load_errors is not None:
            _load_errors.append(message)
        else:
            log.error("llama.cpp: %s", message)


# llama_log_callback is a ctypes CFUNCTYPE, untyped as a decorator: wrapped by a call instead.
_forward_llama_log = llama_cpp.llama_log_callback(_log_to_python)


_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        llama_cpp.llama_log_set(_forward_llama_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


def _load(path: pathlib.Path, gpu_layers: int, vocab_only: bool) -> llama_cpp.llama_model_p:
    """The loaded model; ModelError, with llama.cpp's first complaint, when it is not one llama.cpp can load."""
    global _load_errors
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = gpu_layers
    params.vocab_only = vocab_only
    _load_errors = []
    try:
        model: llama_cpp.llama_model_p | None = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        errors = _load_errors
    finally:
        _load_errors = None
    if not model:
        why = f": {errors[0]}" if errors else ""
        raise ModelError(f"{path} is not a GGUF model llama.cpp can load (damaged, truncated or another format){why}")
    return model


class GgufModel:
    def __init__(self, path: pathlib.Path, gpu_layers: int = 0, vocab_only: bool = False) -> None:
        """`vocab_only`: the vocabulary, tokenizer and chat template without the weights (a front end's, in 0.1 s),
        which tokenizes and renders chats as the whole model does but cannot decode."""
        init_backend()
        model = _load(path, gpu_layers, vocab_only)
        self.path = path
        self.ptr: llama_cpp.llama_model_p | None = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.vocab_size: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.context_length_trained: int = llama_cpp.llama_model_n_ctx_train(model)
        output_layer = self.vocab_size * llama_cpp.llama_model_n_embd(model)
        self.plain_row_share = max(0.5, 1 - output_layer / max(llama_cpp.llama_model_n_params(model), 1))
        """The work of a row without logits relative to one with: all but the output layer's (which a
        model whose input embeddings are its output layer counts once among its parameters)."""
        self.name = self.metadata("general.name") or path.stem
        description = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(model, description, len(description))
        self.quantization = gguf_type(description.value.decode(errors="replace"))
        self.add_bos: bool = llama_cpp.llama_vocab_get_add_bos(self.vocab)
        bos = llama_cpp.llama_vocab_bos(self.vocab)
        self.bos_token_id: int | None = bos if bos >= 0 else None
        self.eos_token_ids = tuple(t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(self.vocab, t))
        self.eos_token_set = frozenset(self.eos_token_ids)
        # Every token read once: its attributes and its text as llama.cpp caches it (special tokens
        # included); output text renders control and unknown tokens as nothing, as llama.cpp does when
        # asked for text without specials.
        self._attrs = [llama_cpp.llama_vocab_get_attr(self.vocab, t) for t in range(self.vocab_size)]
        self._special_pieces = [self._piece(t) for t in range(self.vocab_size)]
        hidden = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        self.pieces: list[bytes] = [b"" if attr & hidden else piece for attr, piece in zip(self._attrs, self._special_pieces)]
        self.special_token_ids = tuple(t for t in range(self.vocab_size) if self._is_special(t))
        self.chat_template = self.metadata("tokenizer.chat_template")
        self._chat = (
            ChatTemplate(
                self.chat_template, self._special_text(bos), self._special_text(llama_cpp.llama_vocab_eos(self.vocab))
            )
            if self.chat_template
            else None
        )
        self._chat_specials = self._parsed_special_tokens() if self._chat else None

    def metadata(self, key: str) -> str | None:
        size = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), None, 0)
        if size < 0:
            return None
        buf = ctypes.create_string_buffer(size + 1)
        llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, size + 1)
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenize_bytes(text.encode("utf-8"), add_special, parse_special)

    def tokenize_bytes(self, data: bytes, add_special: bool = False, parse_special: bool = False) -> list[int]:
        capacity = len(data) + 8
        tokens = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special, parse_special)
        if n < 0:  # the buffer was too small: -n is the size needed
            capacity = -n
            tokens = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special, parse_special)
        return list(tokens[:n])

    def token_piece(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        """Special-token text in message content stays plain text, unless `special_tokens_in_content`."""
        if self._chat is None or self._chat_specials is None:  # both set together, from the template
            raise ChatTemplateError(NO_TEMPLATE)
        if special_tokens_in_content:  # opted into: any special-token text, the callers' too, is a token
            text = self._chat.render(messages, add_generation_prompt, context)
            return self.tokenize(text, add_special=self._adds_bos(text), parse_special=True)
        chat = self._chat.render_marked(messages, add_generation_prompt, context)
        plain = lambda piece: self.tokenize(piece, add_special=False, parse_special=False)  # noqa: E731
        tokens = tokenize_chat(chat, messages, self._chat_specials, plain)
        bos = self.bos_token_id
        return [bos, *tokens] if bos is not None and self._adds_bos(chat.text) else tokens

    def _adds_bos(self, text: str) -> bool:
        """Whether BOS goes before a rendered chat: the template may already start with it; never twice."""
        bos_text = self._special_text(self.bos_token_id) if self.bos_token_id is not None else ""
        return self.add_bos and not (bos_text and text.startswith(bos_text))

    def _parsed_special_tokens(self) -> SpecialTokens:
        """The tokens llama.cpp's special-token parsing matches by text, with their whitespace flags."""
        attrs = list(enumerate(self._attrs))
        parsed = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        return SpecialTokens(
            ((self._special_text(t), t) for t, attr in attrs if attr & parsed),
            lstrip=(t for t, attr in attrs if attr & parsed and attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
            rstrip=(t for t, attr in attrs if attr & parsed and attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP),
        )

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def _piece(self, token: int) -> bytes:
        """A token's text, special tokens included."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def logits_row(self, ctx: llama_cpp.llama_context_p, row: int) -> np.ndarray:
        """A decoded row's logits, a view into llama.cpp's buffer (no copy: writes mask them), valid until the
        next decode."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(self.vocab_size,))

    def new_context(self, sequences: int, tokens_per_sequence: int, batch_tokens: int, threads: int) -> llama_cpp.llama_context_p:
        """A llama.cpp context for `sequences` sequences of up to `tokens_per_sequence` tokens each."""
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = tokens_per_sequence * sequences
        params.n_batch = params.n_ubatch = batch_tokens
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        # A cache per sequence keeps each sequence's attention separate, so greedy output does
        # not depend on what else is in the batch. llama.cpp is fast with it only while a batch's
        # sequences have ascending, contiguous ids (see backend.llamacpp.slots and docs/benchmarks.md).
        params.kv_unified = False
        params.no_perf = True
        ctx: llama_cpp.llama_context_p | None = llama_cpp.llama_init_from_model(self.ptr, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def constraint_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it (about a second to build)."""
        return build_tokenizer(
            self._special_pieces,
            self.special_token_ids,
            self.eos_token_ids,
            self.bos_token_id,
            self.tokenize_bytes,
        )

    def _is_special(self, token: int) -> bool:
        attr = self._attrs[token]
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
            return True
        # User-defined tokens that look like control tokens (<|...|>, <tag>) are special too.
        text = self._special_pieces[token]
        return bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED) and text.startswith(b"<") and text.endswith(b">")

    def _special_text(self, token: int | None) -> str:
        if token is None or token < 0:
            return ""
        return self._special_pieces[token].decode("utf-8", "replace")


def gguf_type(description: str) -> str:
    """The weight type from llama.cpp's model description "<arch> <size> <type>", e.g. "Q4_1" from
    "llama 135M Q4_1" or "Q4_K - Medium" from "llama 8B (guessed) Q4_K - Medium"."""
    parts = description.split(" ", 2)
    return parts[2].removeprefix("(guessed) ") if len(parts) == 3 else description
