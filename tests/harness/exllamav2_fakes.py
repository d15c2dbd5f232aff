"""A fake of exllamav2 0.3.2's dynamic generator for the engine's CPU-side tests.

It behaves like 0.3.2 (generator/dynamic.py) wherever the engine depends on it:

- results: a job's sampled tokens go through the same rules as ExLlamaV2DynamicJob.receive_sample.
  While text is held (a partial stop string, an incomplete UTF-8 character) a result carries
  neither text nor token ids; the held tokens come out later with their text. A stop-token EOS
  is emitted without what is held, so the stop token and anything held before it are only in
  `held`. A stop string is cut from the text, and reported in `eos_triggering_string`.
- the page table: `all_pages`, `referenced_pages` and `unreferenced_pages` as reset_page_table
  builds them (every page free, unused ones too); a started job takes pages for its prompt plus
  max_new_tokens up front, and gives them back when it ends or is cancelled, keeping their keys
  and values for a later prompt.
- preemption: a job's held text and tokens and its banned-string checkpoint under 0.3.2's names
  (held_text, held_tokens, checkpoint), and its random generator (rng, a random.Random of its seed);
  a cancelled job's samples go on in the job with the same identifier enqueued after it.
- threads: the sampling and filter pools of 16 workers each that 0.3.2 starts per generator.
- signatures: jobs and sampler settings take only the keyword arguments 0.3.2's have
  (SETTINGS_FIELDS, JOB_PARAMETERS, GENERATOR_PARAMETERS). The real job and generator swallow
  unknown ones in **kwargs, silently; the fakes refuse them, since one lost that way would show
  only on a GPU.
- loading (FakeLibrary): a model whose cache_map is empty until load() or load_autosplit(), and
  a cache that, built eagerly, puts each layer where cache_map says, the CPU where it says nothing.

Tests may also script raw result dicts per iterate() (`script`), for what the rules above do not
cover (banned-string rewinds, logits, timings).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import random

from backend.config import EngineConfig
from backend.exllamav2.core import ExLlamaV2Core
from backend.exllamav2.held import Resume
from backend.exllamav2.jobs import job_fields, job_input
from backend.exllamav2.preemption import continue_with
from backend.exllamav2.settings import settings_fields, token_bias_values
from backend.types import GenerationRequest
from tests.harness.core_driver import Delivering

EOS = (2,)

# From exllamav2 v0.3.2 (turboderp-org/exllamav2, tag v0.3.2; the same files are in the
# exllamav2-0.3.2-py3-none-any wheel on PyPI): the fields of the ExLlamaV2Sampler.Settings dataclass
# (generator/sampler.py:51-96) and the parameters of ExLlamaV2DynamicJob.__init__
# (generator/dynamic.py:1602-1621) and ExLlamaV2DynamicGenerator.__init__ (dynamic.py:241-259).
# test_exllamav2_signatures.py compares them with that source whenever it is on this machine.
SETTINGS_FIELDS = frozenset({
    "token_repetition_penalty", "token_repetition_range", "token_repetition_decay", "token_frequency_penalty",
    "token_presence_penalty", "temperature", "smoothing_factor", "min_temp", "max_temp", "temp_exponent", "top_k",
    "top_p", "top_a", "min_p", "tfs", "typical", "skew", "temperature_last", "mirostat", "mirostat_tau",
    "mirostat_eta", "mirostat_mu", "token_bias", "cfg_scale", "post_sampling_hooks", "dry_allowed_length",
    "dry_base", "dry_multiplier", "dry_sequence_breakers", "dry_range", "dry_max_ngram", "ngram_trie",
    "ngram_index", "ngram_history", "xtc_probability", "xtc_threshold", "xtc_ignore_tokens",
})
JOB_PARAMETERS = frozenset({
    "input_ids", "max_new_tokens", "min_new_tokens", "max_skips", "gen_settings", "seed", "stop_conditions",
    "decode_special_tokens", "return_top_tokens", "return_logits", "return_probs", "filters",
    "filter_prefer_eos", "token_healing", "identifier", "banned_strings", "embeddings",
})
GENERATOR_PARAMETERS = frozenset({
    "model", "cache", "tokenizer", "max_batch_size", "max_seq_len", "max_chunk_size", "max_q_size", "draft_model",
    "draft_cache", "num_draft_tokens", "use_ngram_draft", "max_ngram", "max_sampling_threads",
    "min_sampling_threads", "paged", "filter_background_eval",
})
PAGE_SIZE = 256


class FakeSettings:
    """ExLlamaV2Sampler.Settings: a dataclass, so an unknown keyword is a TypeError, as there."""

    def __init__(self, **fields) -> None:
        unknown = set(fields) - SETTINGS_FIELDS
        if unknown:
            raise TypeError(f"Settings.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.__dict__.update(fields)


class FakeJob:
    """One ExLlamaV2DynamicJob and the parts of its state receive_sample keeps."""

    def __init__(self, input_ids: list[int], **kwargs) -> None:
        unknown = set(kwargs) - JOB_PARAMETERS
        assert not unknown, f"0.3.2's job would drop these silently: {sorted(unknown)}"
        self.input_ids = list(input_ids)
        self.fields = kwargs
        self.identifier = kwargs.get("identifier")
        self.gen_settings = kwargs.get("gen_settings")
        self.rng = random.Random(kwargs.get("seed"))
        self.checkpoint = None  # set only while a partial banned string is held (not modelled here)
        self.max_new_tokens = kwargs["max_new_tokens"]
        stop = kwargs.get("stop_conditions") or []
        self.stop_tokens = {t for t in stop if isinstance(t, int)}
        self.stop_strings = [s for s in stop if isinstance(s, str)]
        self.return_logits = kwargs.get("return_logits", False)
        # 0.3.2 heals only a prompt longer than one token, and then counts from -1.
        self.new_tokens = -1 if kwargs.get("token_healing") and len(self.input_ids) > 1 else 0
        self.held_pieces: list[bytes] = []
        self.held_ids: list[int] = []
        self.held_logits: list[list[float]] = []
        self.pages: list[FakePage] = []

    @property
    def held_text(self) -> str:
        return b"".join(self.held_pieces).decode("utf-8", "replace")

    @property
    def held_tokens(self) -> list[int]:
        return self.held_ids

    def receive(self, token: int, piece: bytes, logits: list[float] | None) -> dict:
        """The result dict for one sampled token, by receive_sample's rules (dynamic.py:2097-2242)."""
        self.new_tokens += 1
        self.held_pieces.append(piece)
        self.held_ids.append(token)
        if self.return_logits:
            self.held_logits.append(logits)
        if token in self.stop_tokens:  # emitted without emit_held
            return self._emit(eos_reason="stop_token", eos_triggering_token_id=token,
                              eos_triggering_token_str=piece.decode("utf-8", "replace"))
        if self.new_tokens >= self.max_new_tokens:
            return self._emit(release=True, eos_reason="max_new_tokens")
        text = b"".join(self.held_pieces).decode("utf-8", "replace")
        if text.endswith("\ufffd"):  # an incomplete character: hold
            return self._emit()
        match = _partial_strings_match(text, self.stop_strings)
        if match >= 0:
            stop = next(s for s in self.stop_strings if text[match:].startswith(s))
            return self._emit(release=True, cut=match, eos_reason="stop_string", eos_triggering_string=stop)
        if match == -2:  # a partial stop string: hold
            return self._emit()
        return self._emit(release=True)

    def _emit(self, release: bool = False, cut: int | None = None, **eos) -> dict:
        result = {"job": self, "stage": "streaming", "eos": bool(eos), "serial": 1}
        text = b"".join(self.held_pieces).decode("utf-8", "replace")
        if release:
            if text[:cut]:
                result["text"] = text[:cut]
            if self.held_ids:
                result["token_ids"] = [self.held_ids]
            if self.held_logits:
                result["logits"] = [self.held_logits]
            self.held_pieces, self.held_ids, self.held_logits = [text[cut:].encode()] if cut is not None else [], [], []
        if eos:
            result |= eos | eos_timings(self.new_tokens, len(self.input_ids))
            held = {"text": b"".join(self.held_pieces).decode("utf-8", "replace"), "token_ids": [self.held_ids],
                    "logits": [self.held_logits]}
            held = {key: value for key, value in held.items() if value and value != [[]]}
            if held:
                result["held"] = held
        if self.identifier is not None:
            result["identifier"] = self.identifier
        return result


def _partial_strings_match(text: str, strings: list[str]) -> int:
    """ext_c.partial_strings_match: where the first string (in order) occurs whole, else -2 if the text
    ends with the start of one, else -1 (exllamav2_ext/cpp/generator.cpp:12-54)."""
    for string in strings:
        for start in range(len(text)):
            if text[start:].startswith(string):
                return start
            if string.startswith(text[start:]):
                return -2
    return -1


@dataclasses.dataclass
class FakePage:
    """The CachePage fields the engine reads (dynamic.py:60-82)."""

    page_index: int
    phash: int
    ref_count: int = 0
    kv_position: int = 0


class FakeGenerator:
    """The generator's queue API (enqueue / cancel / iterate) and page table, as 0.3.2 has them.

    `samples[identifier]` lists (token id, piece bytes[, logits row]) the job samples, one per
    iterate(); `script` lists raw result lists that iterate() returns first, instead.
    """

    def __init__(self, cache_tokens: int = 4096, paged: bool = True) -> None:
        self.script: list[list[dict]] = []
        self.samples: dict[str, list[tuple]] = {}
        self.enqueued: list[FakeJob] = []
        self.cancelled: list[FakeJob] = []
        self.pending: list[FakeJob] = []
        self.active: list[FakeJob] = []
        self.explode = False
        self.page_size = PAGE_SIZE if paged else cache_tokens
        self.max_pages = cache_tokens // self.page_size
        self._hashes = itertools.count()
        self.all_pages = [FakePage(index, next(self._hashes)) for index in range(self.max_pages)]
        self.referenced_pages: dict[int, FakePage] = {}
        self.unreferenced_pages = {page.phash: page for page in self.all_pages}
        self.sampling_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
        self.filter_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)

    def enqueue(self, job: FakeJob) -> int:
        needed = self._pages_needed(job)
        assert needed <= self.max_pages, (
            f"Job requires {needed} pages (only {self.max_pages} available) and cannot be enqueued"
        )
        self.enqueued.append(job)
        self.pending.append(job)
        return len(self.enqueued)

    def cancel(self, job: FakeJob) -> None:
        """Frees the job's pages; emits nothing (dynamic.py:856-872)."""
        self.cancelled.append(job)
        if job in self.pending:
            self.pending.remove(job)
        if job in self.active:
            self._finish(job)

    def iterate(self) -> list[dict]:
        if self.explode:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.script:
            return self.script.pop(0)
        results = []
        for job in list(self.pending):  # start what fits (no batch limit here)
            if self._pages_needed(job) <= len(self.unreferenced_pages):
                self.pending.remove(job)
                self._start(job)
                results.append({"job": job, "stage": "started", "eos": False, "serial": 1, "identifier": job.identifier})
        for job in list(self.active):
            queued = self.samples.get(job.identifier)
            if queued:
                token, piece, *logits = queued.pop(0)
                result = job.receive(token, piece, logits[0] if logits else None)
                results.append(result)
                if result["eos"]:
                    self._finish(job)
        return results

    def _pages_needed(self, job: FakeJob) -> int:
        return -(-(len(job.input_ids) + job.max_new_tokens) // self.page_size)

    def _start(self, job: FakeJob) -> None:
        """Takes the oldest free pages, and prefills the prompt into them."""
        self.active.append(job)
        for _ in range(self._pages_needed(job)):
            page = self.unreferenced_pages.pop(next(iter(self.unreferenced_pages)))
            page.ref_count, page.kv_position = 1, 0
            self.referenced_pages[page.phash] = page
            job.pages.append(page)
        for index, page in enumerate(job.pages):
            page.kv_position = max(0, min(self.page_size, len(job.input_ids) - index * self.page_size))

    def _finish(self, job: FakeJob) -> None:
        """Deallocates the job's pages: free again, their keys and values kept (CachePage.sub_ref)."""
        self.active.remove(job)
        for page in job.pages:
            page.ref_count -= 1
            del self.referenced_pages[page.phash]
            self.unreferenced_pages[page.phash] = page
        job.pages = []


class FakeGenerators(list):
    """ExLlamaV2Core's make_generator: each call makes (and keeps) a FakeGenerator, or fails while `failing`."""

    failing = False

    def __init__(self, **generator_options) -> None:
        super().__init__()
        self._options = generator_options

    def __call__(self) -> FakeGenerator:
        if self.failing:
            raise RuntimeError("CUDA out of memory")
        self.append(FakeGenerator(**self._options))
        return self[-1]


class FakeModel:
    """ExLlamaV2: cache_map (layer -> device) stays empty until a load fills it (model.py:89, 348, 699-704)."""

    layers = 4

    def __init__(self, config) -> None:
        self.config = config
        self.cache_map: dict[int, str] = {}

    def load(self, gpu_split: list[float]) -> None:
        self.cache_map = {layer: f"cuda:{layer * len(gpu_split) // self.layers}" for layer in range(self.layers)}

    def load_autosplit(self, cache: FakeCache) -> None:
        assert cache.lazy, "load_autosplit allocates a lazy cache as it loads"
        self.cache_map = {layer: "cuda:0" for layer in range(self.layers)}
        cache.devices = [self.cache_map[layer] for layer in range(self.layers)]


class FakeCache:
    """ExLlamaV2Cache: built eagerly, each layer goes to model.cache_map's device, or the CPU (None)
    where the map has none (cache.py:85-90); a lazy one is allocated by load_autosplit."""

    def __init__(self, model: FakeModel, max_seq_len: int = -1, lazy: bool = False) -> None:
        self.max_seq_len, self.lazy = max_seq_len, lazy
        self.devices = None if lazy else [model.cache_map.get(layer) for layer in range(model.layers)]


class FakeLibrary:
    """The `exllamav2` module, as far as loading a model and its cache goes."""

    ExLlamaV2 = FakeModel
    ExLlamaV2Cache = ExLlamaV2Cache_Q4 = ExLlamaV2Cache_Q6 = ExLlamaV2Cache_Q8 = FakeCache


def no_breakers(breakers: tuple[str, ...]) -> frozenset[int]:
    return frozenset()


class FakeJobs:
    """ExLlamaV2Core's make_job, as the engine's builds a job: the fake settings and job take the same
    keywords, so one 0.3.2 lacks fails here. A test assigns a grammar filter core by request id."""

    def __init__(self, eos_token_ids: tuple[int, ...] = EOS) -> None:
        self.constraints: dict = {}
        self._eos_token_ids = eos_token_ids

    def __call__(self, request: GenerationRequest, resume: Resume | None = None, compiled=None):
        if request.request_id == "explode":
            raise TypeError("Settings.__init__() got an unexpected keyword argument")
        if resume is not None:
            settings = resume.previous.gen_settings
        else:
            settings = FakeSettings(**settings_fields(request, no_breakers))
            settings.token_bias = token_bias_values(request, self._eos_token_ids) or None
        constraint = self.constraints.get(request.request_id)
        output = resume.output if resume is not None else ()
        job = FakeJob(job_input(request, output), gen_settings=settings, filters=[constraint] if constraint else None,
                      **job_fields(request, self._eos_token_ids, len(output)))
        return (job if resume is None else continue_with(job, resume.previous)), constraint


def eos_timings(new_tokens: int, prompt_tokens: int) -> dict:
    """The figures every EOS result carries (dynamic.py:2055-2072)."""
    return {"new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "time_enqueued": 0.01, "time_prefill": 0.02,
            "time_generate": 0.3, "cached_pages": 0, "cached_tokens": 0, "full_completion": ""}


def streaming(identifier: str, ids: list[int] | None = None, text: str | None = None, **extra) -> dict:
    """A raw streaming result, for `script`."""
    result = {"job": None, "stage": "streaming", "eos": False, "serial": 1, "identifier": identifier}
    if ids is not None:
        result["token_ids"] = [ids]
    if text is not None:
        result["text"] = text
    result.update(extra)
    return result


def eos(identifier: str, reason: str, new_tokens: int, **extra) -> dict:
    """A raw EOS result, for `script`."""
    return streaming(identifier, **({"eos": True, "eos_reason": reason} | eos_timings(new_tokens, 3) | extra))


def fake_core(vocab_size: int = 64, **settings: object) -> tuple[Delivering, FakeGenerators]:
    """An ExLlamaV2Core with these engine settings on fake generators and jobs, driven step by step,
    and its generators."""
    generators = FakeGenerators()
    config = EngineConfig.of(**settings)
    core = ExLlamaV2Core(generators, FakeJobs(), EOS, lambda token: b"x", vocab_size=vocab_size, cache_tokens=4096,
                         config=config)
    return Delivering(core), generators
