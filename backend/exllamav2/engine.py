"""The exllamav2 engine: an EXL2 or GPTQ model directory served by one worker thread.

Everything exllamav2 (and torch) is imported inside `ExLlamaV2Engine.__init__`:
`import exllamav2` compiles a CUDA extension. Not yet exercised on a GPU: the
parts it builds on (ExLlamaV2Core, JobResults, job and sampler fields, the filter
core) are tested on CPU against a fake generator.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from typing import Sequence

from backend.chat import NO_TEMPLATE, ChatTemplate, ChatTemplateError, SpecialTokens, tokenize_chat
from backend.config import EngineConfig
from backend.constraints import ConstraintCompiler
from backend.engine import CONSTRAINT_KINDS, ChatMessage, EngineUnavailable, ModelInfo
from backend.exllamav2.core import ExLlamaV2Core
from backend.exllamav2.filter_core import GrammarFilterCore, filter_class
from backend.exllamav2.jobs import budget_problem, job_fields
from backend.exllamav2.model_files import adds_bos, end_token_ids, weight_format
from backend.exllamav2.settings import SUPPORTED_SAMPLERS, padded_logit_width, sequence_breaker_ids, settings_fields
from backend.types import GenerationRequest
from backend.worker import EngineWorker, WorkerEngine

log = logging.getLogger(__name__)

PAGE_SIZE = 256  # the dynamic generator's page: cache sizes and prefill chunks are multiples of it


MAX_CHUNK_TOKENS = 2048
"""Most prompt tokens the generator prefills in one forward pass (a multiple of PAGE_SIZE)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ExLlamaV2Engine(WorkerEngine):
    def __init__(self, model_dir: pathlib.Path, config: EngineConfig = EngineConfig()) -> None:
        import llguidance

        try:  # importing exllamav2 compiles its CUDA extension, which can fail in many ways
            import torch
            from exllamav2 import (
                ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Cache_Q4, ExLlamaV2Cache_Q6, ExLlamaV2Cache_Q8, ExLlamaV2Tokenizer,
            )
            from exllamav2 import ExLlamaV2Config as XConfig
            from exllamav2.attn import has_flash_attn_with_paged
            from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
        except (ImportError, OSError, RuntimeError) as exc:
            raise EngineUnavailable(
                "the exllamav2 engine needs a CUDA build of torch and exllamav2, which compiles its extension "
                f"on first import (pip install 'tokenspout[exllamav2]'): {type(exc).__name__}: {exc}"
            ) from exc

        self._torch = torch
        xconfig = XConfig(str(model_dir))
        xconfig.arch_compat_overrides()
        own = config.exllamav2
        xconfig.max_seq_len = config.context_length
        chunk = max(PAGE_SIZE, min(MAX_CHUNK_TOKENS, xconfig.max_seq_len))
        xconfig.max_input_len = chunk
        xconfig.max_attention_size = chunk**2
        # exllamav2's own verdict: flash-attn >= 2.5.7 that imports, unless EXLLAMA_NO_FLASH_ATTN is set.
        self.paged = has_flash_attn_with_paged
        batch_size = config.max_batch_size if self.paged else 1
        if not self.paged:
            log.warning("flash-attn >= 2.5.7 not found: exllamav2 runs unpaged, one request at a time")
        cache_tokens = _round_up(own.cache_tokens or xconfig.max_seq_len * batch_size, PAGE_SIZE)
        cache_class = {"fp16": ExLlamaV2Cache, "q4": ExLlamaV2Cache_Q4, "q6": ExLlamaV2Cache_Q6, "q8": ExLlamaV2Cache_Q8}[
            own.cache_type
        ]
        self.model = ExLlamaV2(xconfig)
        self.cache = cache_class(self.model, max_seq_len=cache_tokens, lazy=not own.gpu_split)
        if own.gpu_split:
            self.model.load(list(own.gpu_split))
        else:
            self.model.load_autosplit(self.cache)
        self.tokenizer = ExLlamaV2Tokenizer(xconfig, lazy_init=False)
        self.max_seq_len = xconfig.max_seq_len
        self.cache_tokens = cache_tokens
        self.eos_token_ids = end_token_ids(model_dir, self.tokenizer.eos_token_id)
        self._pieces = [p.encode() for p in self.tokenizer.get_id_to_piece_list(False)]
        tokenizer_config = self.tokenizer.tokenizer_config_dict or {}
        self._add_bos = adds_bos(model_dir, self.tokenizer.bos_token or "")
        template = tokenizer_config.get("chat_template")
        self._chat = (
            ChatTemplate(template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or "")
            if isinstance(template, str)
            else None
        )
        tokenizer_json = (model_dir / "tokenizer.json").read_text()
        ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=xconfig.vocab_size, eos_token=list(self.eos_token_ids))
        self.constraints = ConstraintCompiler(ll_tokenizer, limits=config.constraint)
        self.info = ModelInfo(
            model_id=config.model_id or model_dir.name,
            engine="exllamav2" if self.paged else "exllamav2 (unpaged: one request at a time)",
            context_length=self.max_seq_len,
            vocab_size=xconfig.vocab_size,
            max_batch_size=batch_size,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_ids=self.eos_token_ids,
            has_chat_template=self._chat is not None,
            samplers=SUPPORTED_SAMPLERS,
            constraint_kinds=CONSTRAINT_KINDS,
            quantization=weight_format(model_dir),
        )
        filter_type = filter_class()
        pieces_with_special = self.tokenizer.get_id_to_piece_list(True)

        @functools.lru_cache(maxsize=16)  # one scan of the vocabulary per set of breakers
        def breaker_ids(breakers: tuple[str, ...]) -> frozenset[int]:
            return frozenset(sequence_breaker_ids(pieces_with_special, breakers))

        def make_generator():
            return ExLlamaV2DynamicGenerator(
                model=self.model, cache=self.cache, tokenizer=self.tokenizer, max_batch_size=batch_size,
                max_seq_len=self.max_seq_len, max_chunk_size=chunk, paged=self.paged, filter_background_eval=True,
            )

        def make_job(request: GenerationRequest):
            constraint = filters = None
            if request.constraint is not None:
                constraint = GrammarFilterCore(request.constraint, self.eos_token_ids, xconfig.vocab_size)
                filters = [filter_type(self.model, self.tokenizer, constraint)]
            settings = ExLlamaV2Sampler.Settings(**settings_fields(request, breaker_ids))
            if request.sampling.logit_bias:
                settings.token_bias = torch.zeros(padded_logit_width(xconfig.vocab_size), dtype=torch.float32)
                for token, bias in request.sampling.logit_bias.items():
                    settings.token_bias[token] = bias
            job = ExLlamaV2DynamicJob(
                input_ids=torch.tensor([request.prompt_token_ids], dtype=torch.long),
                gen_settings=settings,
                filters=filters,
                **job_fields(request, self.eos_token_ids),
            )
            return job, constraint

        self.core = ExLlamaV2Core(
            make_generator, make_job, self.eos_token_ids, self.token_piece, len(self._pieces), cache_tokens
        )
        self._worker = EngineWorker(self.core, name="exllamav2-engine")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_bos=add_special and self._add_bos, encode_special_tokens=False)
        return ids[0].tolist()

    def budget_problem(self, prompt_tokens: int, max_new_tokens: int) -> str:
        return budget_problem(prompt_tokens, max_new_tokens, self.max_seq_len, self.cache_tokens)

    def token_piece(self, token_id: int) -> bytes:
        return self._pieces[token_id] if token_id < len(self._pieces) else b""

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False
    ) -> list[int]:
        if self._chat is None:
            raise ChatTemplateError(NO_TEMPLATE)
        encode = lambda text, special: self.tokenizer.encode(  # noqa: E731
            text, add_bos=False, encode_special_tokens=special
        )[0].tolist()
        if special_tokens_in_content:  # opted into: any special-token text, the callers' too, is a token
            return encode(self._chat.render(messages, add_generation_prompt), True)
        chat = self._chat.render_marked(messages, add_generation_prompt)
        # exllamav2 parses the special added tokens (extended_piece_to_id) by text, like this.
        specials = SpecialTokens(self.tokenizer.extended_piece_to_id.items())
        return tokenize_chat(chat, messages, specials, lambda piece: encode(piece, False))

    def close(self) -> None:
        self._worker.close()
        self.model.unload()
