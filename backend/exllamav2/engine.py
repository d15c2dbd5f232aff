"""The exllamav2 engine: an EXL2 or GPTQ model directory served by one worker thread.

Everything exllamav2 (and torch) is imported inside `ExLlamaV2Engine.__init__`:
`import exllamav2` compiles a CUDA extension. bench/gpu/ serves it on a GPU and checks the
serving contract there (README.md, "What is proven"); on CPU the parts it builds on
(ExLlamaV2Core, JobResults, job and sampler fields, the filter core, the generator's sizes,
the model-then-cache order, the vocabulary) are tested against fakes that behave like
exllamav2 0.3.2 and a real tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Sequence
from typing import Any

from backend.common.chat import ChatTemplate
from backend.config import EngineConfig
from backend.constraints import CompiledConstraint, ConstraintCompiler
from backend.engine import EngineUnavailable
from backend.exllamav2.attention_provider import NONE, describe, import_exllamav2
from backend.exllamav2.core import ExLlamaV2Core
from backend.exllamav2.filter_core import GrammarFilterCore, filter_class
from backend.exllamav2.held import Resume
from backend.exllamav2.jobs import job_fields, job_input
from backend.exllamav2.loading import load_model_and_cache, unavailable_message
from backend.exllamav2.model_files import adds_bos, end_token_ids, find_model_dir, unloadable_weights, weight_format
from backend.exllamav2.preemption import continue_with
from backend.exllamav2.settings import (
    SUPPORTED_SAMPLERS,
    padded_logit_width,
    sequence_breaker_ids,
    settings_fields,
    token_bias_values,
)
from backend.exllamav2.sizes import PAGE_SIZE, generator_fields, generator_sizes, speculation
from backend.local_engine import WorkerEngine
from backend.tools import detect_format, detect_reasoning
from backend.types import CONSTRAINT_KINDS, ChatContext, ChatMessage, GenerationRequest, ModelInfo, PrefixReuse

log = logging.getLogger(__name__)

EXLLAMAV2_REQUEST_FEATURES = ("prompt_token_ids", "n", "truncate_input_tokens")

class ExLlamaV2Engine(WorkerEngine):
    def __init__(self, model_dir: pathlib.Path, config: EngineConfig = EngineConfig()) -> None:
        import llguidance

        problem = unloadable_weights(model_dir)  # before the import, which compiles for minutes
        if problem:
            raise EngineUnavailable(problem)
        try:  # importing exllamav2 compiles its CUDA extension, which can fail in many ways
            exllamav2, provider = import_exllamav2(config.exllamav2.attention)
            import torch
            from exllamav2.attn import has_flash_attn_with_paged
            from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

            from backend.exllamav2.vocabulary import Vocabulary  # tokenizers: in the exllamav2 extra
        except (ImportError, OSError, RuntimeError) as exc:
            raise EngineUnavailable(unavailable_message(exc)) from exc

        own = config.exllamav2
        xconfig = exllamav2.ExLlamaV2Config(str(model_dir))
        xconfig.arch_compat_overrides()
        try:
            sizes = generator_sizes(config, has_flash_attn_with_paged, xconfig.no_flash_attn)
        except ValueError as exc:
            raise EngineUnavailable(f"exllamav2 cannot run with these settings: {exc}") from exc
        if not sizes.paged:
            why = "this model turns paged attention off" if has_flash_attn_with_paged else f"attention {own.attention}"
            log.warning("%s: exllamav2 runs unpaged, one request at a time", why)
            provider = NONE
        log.info(describe(provider, sizes.paged, sizes.batch))
        xconfig.max_seq_len = sizes.max_seq_len
        xconfig.max_input_len = sizes.chunk
        xconfig.max_attention_size = sizes.chunk**2
        self.paged = sizes.paged
        self.model, self.cache = load_model_and_cache(exllamav2, xconfig, own.cache_type, sizes.cache_tokens, own.gpu_split)
        draft = {}
        if own.draft_model:  # its cache must have the main one's size (dynamic.py:345-351)
            draft_config = exllamav2.ExLlamaV2Config(str(find_model_dir(own.draft_model, "draft_model")))
            draft_config.arch_compat_overrides()
            if draft_config.vocab_size != xconfig.vocab_size:
                raise EngineUnavailable(
                    f"draft_model: its vocabulary has {draft_config.vocab_size} tokens, the model's {xconfig.vocab_size}"
                )
            draft_config.max_seq_len, draft_config.max_input_len = sizes.max_seq_len, sizes.chunk
            draft_config.max_attention_size = sizes.chunk**2
            draft_model, draft_cache = load_model_and_cache(
                exllamav2, draft_config, own.cache_type, sizes.cache_tokens, own.gpu_split
            )
            draft = {"draft_model": draft_model, "draft_cache": draft_cache}
        drafts = speculation(config, bool(draft))
        self.tokenizer = exllamav2.ExLlamaV2Tokenizer(xconfig, lazy_init=False)
        self.eos_token_ids = end_token_ids(model_dir, self.tokenizer.eos_token_id)
        tokenizer_json = (model_dir / "tokenizer.json").read_text()
        ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=xconfig.vocab_size, eos_token=list(self.eos_token_ids))
        constraints = ConstraintCompiler(ll_tokenizer, limits=config.constraint)
        template = (self.tokenizer.tokenizer_config_dict or {}).get("chat_template")
        chat = (
            ChatTemplate(template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or "")
            if isinstance(template, str)
            else None
        )
        tool_format = detect_format(template) if isinstance(template, str) else None
        reasoning = detect_reasoning(template) if isinstance(template, str) else None
        add_bos = adds_bos(model_dir, self.tokenizer.bos_token or "")
        self.vocabulary = Vocabulary(tokenizer_json, ll_tokenizer, self.tokenizer.bos_token_id, add_bos, chat)
        self.info = ModelInfo(
            model_id=config.model_id or model_dir.name,
            engine="exllamav2" if self.paged else "exllamav2 (unpaged: one request at a time)",
            context_length=sizes.max_seq_len,
            vocab_size=xconfig.vocab_size,
            max_batch_size=sizes.batch,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_ids=self.eos_token_ids,
            has_chat_template=chat is not None,
            template_tool_format=tool_format.name if tool_format else "",
            template_reasoning_format=reasoning.name if reasoning else "",
            samplers=SUPPORTED_SAMPLERS,
            constraint_kinds=CONSTRAINT_KINDS,
            quantization=weight_format(model_dir),
            speculation_modes=(drafts.mode,),
            default_speculation=drafts,
            draft_tokens_per_request=False,
            # Token input and truncation are the service's; n samples are n jobs sharing the prompt's pages
            # (backend.exllamav2.held); its generator has no prompt logprobs: UNIMPLEMENTED here.
            request_features=EXLLAMAV2_REQUEST_FEATURES,
            attention_provider=provider,
            reuses_decoded_cells=self.paged,  # its cache pages keep generated tokens as decoded
            prefix_reuse=PrefixReuse.AS_CACHED if self.paged else PrefixReuse.OFF,
            cache_tokens=sizes.cache_tokens,  # the generator reserves whole pages for prompt + max_new_tokens up front
            cache_page_tokens=PAGE_SIZE,
        )
        filter_type = filter_class()
        pieces_with_special = self.tokenizer.get_id_to_piece_list(True)

        @functools.lru_cache(maxsize=16)  # one scan of the vocabulary per set of breakers
        def breaker_ids(breakers: tuple[str, ...]) -> frozenset[int]:
            return frozenset(sequence_breaker_ids(pieces_with_special, breakers))

        def make_generator() -> Any:
            return ExLlamaV2DynamicGenerator(
                model=self.model, cache=self.cache, tokenizer=self.tokenizer, **draft, **generator_fields(sizes, drafts)
            )

        def make_job(
            request: GenerationRequest, resume: Resume | None, compiled: CompiledConstraint | None,
        ) -> tuple[Any, GrammarFilterCore | None]:
            """A request's job; given a Resume, the one that continues it after a preemption (never constrained)."""
            constraint = filters = None
            if compiled is not None:
                constraint = GrammarFilterCore(compiled, self.eos_token_ids, xconfig.vocab_size)
                filters = [filter_type(self.model, self.tokenizer, constraint)]
            if resume is not None:
                settings = resume.previous.gen_settings  # with what it carries (mirostat's mu)
            else:
                settings = ExLlamaV2Sampler.Settings(**settings_fields(request, breaker_ids))
                bias = token_bias_values(request, self.eos_token_ids)
                if bias:
                    settings.token_bias = torch.zeros(padded_logit_width(xconfig.vocab_size), dtype=torch.float32)
                    for token, value in bias.items():
                        settings.token_bias[token] = value
            output = resume.output if resume is not None else ()
            job = ExLlamaV2DynamicJob(
                input_ids=torch.tensor([job_input(request, output)], dtype=torch.long),
                gen_settings=settings,
                filters=filters,
                **job_fields(request, self.eos_token_ids, len(output)),
            )
            return (job if resume is None else continue_with(job, resume.previous)), constraint

        batched = dataclasses.replace(config, max_batch_size=sizes.batch)
        core = ExLlamaV2Core(
            make_generator, make_job, self.eos_token_ids, self.token_piece, len(self.vocabulary.pieces), sizes.cache_tokens,
            batched,
        )
        self._serve(core, constraints, batched, name="exllamav2-engine")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.vocabulary.tokenize(text, add_special)

    def token_piece(self, token_id: int) -> bytes:
        return self.vocabulary.piece(token_id)

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        return self.vocabulary.render_chat(messages, add_generation_prompt, special_tokens_in_content, context)

    def close(self) -> None:
        self._stop()
        self.model.unload()
