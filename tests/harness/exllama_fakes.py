"""Doubles of both exllama generations' generators, for the shared core's CPU tests: what exllamav2 0.3.2
and exllamav3 1.6.5 do alike, written once (each generation's own part is in exllamav2_fakes.py and
exllamav3_fakes.py, with the keyword lists pinned from its source).

- results: a job's sampled tokens go through the rules both generations' Job.receive_sample keep.
  While text is held (a partial stop string, an incomplete UTF-8 character) a result carries
  neither text nor token ids; the held tokens come out later with their text. A stop-token EOS
  is emitted without what is held, so the stop token and anything held before it are only in
  `held`. A stop string is cut from the text, and reported in `eos_triggering_string`. Tensors
  in results ((1, n) ids, (1, n, vocabulary) logits) are numpy arrays here: the same `tolist()`.
- the page table: every page free at first, unused ones too; a started job takes pages for its
  prompt plus max_new_tokens up front, and gives them back when it ends or is cancelled, keeping
  their keys and values for a later prompt.
- preemption: a job's held text and tokens and its banned-string checkpoint under both generations'
  names (held_text, held_tokens, checkpoint), its random generator (rng), and the counts it keeps as
  it runs (cached_pages, cached_tokens, accepted_draft_tokens, rejected_draft_tokens).

Tests may also script raw result dicts per iterate() (`script`), for what the rules above do not
cover (banned-string rewinds, logits, timings).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import pathlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from backend.config import EngineConfig
from backend.exllama.core import ExllamaCore
from backend.exllama.results import Translation
from tests.harness.core_driver import Delivering

EOS = (2,)
PAGE_SIZE = 256
GENERATIONS = ("exllamav2", "exllamav3")
_TENSORS = ("token_ids", "suppressed_tokens", "logits")


class FakeJob:
    """One generator job and the parts of its state receive_sample keeps; each generation's names its keywords."""

    PARAMETERS: frozenset[str] = frozenset()
    """Its keyword arguments, as the generation's own job takes them (the real ones swallow others silently)."""

    def __init__(self, input_ids: Any, **kwargs: Any) -> None:
        unknown = set(kwargs) - self.PARAMETERS
        assert not unknown, f"the real job would drop these silently: {sorted(unknown)}"
        assert tuple(input_ids.shape)[0] == 1, "input_ids are a (1, n) tensor"
        self.input_ids = input_ids.tolist()[0]
        self.fields = kwargs
        self.identifier = kwargs.get("identifier")
        self.checkpoint = None  # set only while a partial banned string is held (not modelled here)
        self.max_new_tokens = kwargs["max_new_tokens"]
        stop = kwargs.get("stop_conditions") or []
        self.stop_tokens = {t for t in stop if isinstance(t, int)}
        self.stop_strings = [s for s in stop if isinstance(s, str)]
        self.return_logits = kwargs.get("return_logits", False)
        # Both heal only a prompt longer than one token, and then count from -1.
        self.new_tokens = -1 if kwargs.get("token_healing") and len(self.input_ids) > 1 else 0
        self.held_pieces: list[bytes] = []
        self.held_ids: list[int] = []
        self.held_logits: list[list[float]] = []
        self.pages: list[FakePage] = []
        self.cached_pages = self.cached_tokens = self.accepted_draft_tokens = self.rejected_draft_tokens = 0

    @property
    def sampling(self) -> Any:
        """What it samples with: exllamav2's gen_settings, exllamav3's sampler."""
        return self.fields.get("gen_settings", self.fields.get("sampler"))

    @property
    def held_text(self) -> str:
        return b"".join(self.held_pieces).decode("utf-8", "replace")

    @property
    def held_tokens(self) -> list[int]:
        return self.held_ids

    def receive(self, token: int, piece: bytes, logits: list[float] | None) -> dict:
        """The result dict for one sampled token, by receive_sample's rules (0.3.2 dynamic.py:2097-2242)."""
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
                result["held"] = as_tensors(held)
        if self.identifier is not None:
            result["identifier"] = self.identifier
        return as_tensors(result)


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
    """The page fields the engine reads (0.3.2 dynamic.py:60-82, 1.6.5 pagetable.py CachePage)."""

    page_index: int
    phash: int
    ref_count: int = 0
    kv_position: int = 0


class FakeGenerator:
    """The generator's queue API (enqueue / cancel / iterate) and page table, as both generations have them.

    `samples[identifier]` lists (token id, piece bytes[, logits row]) the job samples, one per
    iterate(); `script` lists raw result lists that iterate() returns first, instead.
    """

    def __init__(self, cache_tokens: int, page_size: int) -> None:
        self.script: list[list[dict]] = []
        self.samples: dict[str, list[tuple]] = {}
        self.enqueued: list[FakeJob] = []
        self.cancelled: list[FakeJob] = []
        self.pending: list[FakeJob] = []
        self.active: list[FakeJob] = []
        self.explode = False
        self.page_size = page_size
        self.max_pages = cache_tokens // page_size
        self._hashes = itertools.count()
        self.pages = [FakePage(index, next(self._hashes)) for index in range(self.max_pages)]
        self.referenced_pages: dict[int, FakePage] = {}
        self.unreferenced_pages = {page.phash: page for page in self.pages}

    def enqueue(self, job: FakeJob) -> int:
        needed = self._pages_needed(job)
        assert needed <= self.max_pages, (
            f"Job requires {needed} pages (only {self.max_pages} available) and cannot be enqueued"
        )
        self.enqueued.append(job)
        self.pending.append(job)
        return len(self.enqueued)

    def cancel(self, job: FakeJob) -> None:
        """Frees the job's pages; emits nothing (0.3.2 dynamic.py:856-872, 1.6.5 Generator.cancel)."""
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
        """Deallocates the job's pages: free again, their keys and values kept."""
        self.active.remove(job)
        for page in job.pages:
            page.ref_count -= 1
            del self.referenced_pages[page.phash]
            self.unreferenced_pages[page.phash] = page
        job.pages = []


class FakeGenerators(list):
    """The generator class a binding builds with: each call makes (and keeps) one of `kind`, or fails while
    `failing`."""

    failing = False

    def __init__(self, kind: Callable[..., FakeGenerator]) -> None:
        super().__init__()
        self._kind = kind

    def __call__(self, **fields: Any) -> FakeGenerator:
        if self.failing:
            raise RuntimeError("CUDA out of memory")
        self.append(self._kind(**fields))
        return self[-1]


class FakeTokenizer:
    """What the bindings read of the library's tokenizer: the pieces (DRY breakers, XTC), BOS and EOS."""

    bos_token_id, eos_token_id = 1, 2

    def __init__(self, vocab_size: int) -> None:
        self.pieces = [f"t{token}" for token in range(vocab_size)]

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        return self.pieces


def as_tensors(result: dict) -> dict:
    """The result with its ids and logits as arrays, as the generators give them (tensors)."""
    return {key: np.asarray(value) if key in _TENSORS and isinstance(value, list) else value
            for key, value in result.items()}


def eos_timings(new_tokens: int, prompt_tokens: int) -> dict:
    """The figures every EOS result carries (0.3.2 dynamic.py:2055-2072, 1.6.5 job.py emit)."""
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
    return as_tensors(result)


def eos(identifier: str, reason: str, new_tokens: int, **extra) -> dict:
    """A raw EOS result, for `script`."""
    return streaming(identifier, **({"eos": True, "eos_reason": reason} | eos_timings(new_tokens, 3) | extra))


def fake_core(generation: str, vocab_size: int = 64, piece: Callable[[int], bytes] = lambda token: b"x",
              eos_token_ids: tuple[int, ...] = EOS, cache_tokens: int = 4096,
              **settings: object) -> tuple[Delivering, FakeGenerators]:
    """The shared core over `generation`'s real binding on its doubles, with these engine settings, driven step
    by step, and the generators it built."""
    from tests.harness import exllamav2_fakes, exllamav3_fakes

    fakes = {"exllamav2": exllamav2_fakes, "exllamav3": exllamav3_fakes}[generation]
    config = EngineConfig.of(**settings)
    generators = FakeGenerators(fakes.FakeGenerator)
    binding = fakes.binding(generators, vocab_size, eos_token_ids, cache_tokens, config)
    translation = Translation(frozenset(eos_token_ids), piece, vocab_size, binding.suppressed_ids_stay)
    return Delivering(ExllamaCore(binding, translation, cache_tokens, config)), generators


def filter_core_of(generators: FakeGenerators, request_id: str):
    """The grammar filter core of a request's job, through the filter shell the binding gave the job."""
    job = next(job for generator in generators for job in generator.enqueued if job.identifier == request_id)
    return job.fields["filters"][0].core


def fake_job_class(generation: str) -> type[FakeJob]:
    """The job double of `generation`."""
    from tests.harness import exllamav2_fakes, exllamav3_fakes

    return {"exllamav2": exllamav2_fakes.FakeJob, "exllamav3": exllamav3_fakes.FakeJob}[generation]


def safetensors_with(path, *names: str, dtype: str = "I32", **shapes: list[int]) -> None:
    """A safetensors file's header (names, or name=shape with dots as double underscores), data omitted."""
    tensors = dict.fromkeys(names, [1]) | {name.replace("__", "."): shape for name, shape in shapes.items()}
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 2]} for name, shape in tensors.items()})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0\0")


SOURCES = pathlib.Path.home() / ".cache" / "tokenspout" / "sources"
"""Where tools/exllama_sources.sh unpacks the libraries' PyPI wheels (pure Python: their source)."""


def library_source(name: str, version: str) -> pathlib.Path | None:
    """The package folder of `name` at `version`, found without importing it (that compiles CUDA code): under
    $<NAME>_SOURCE (an unpacked wheel or repository), installed, or unpacked by tools/exllama_sources.sh."""
    variable = f"{name.upper()}_SOURCE"
    if os.environ.get(variable):
        return pathlib.Path(os.environ[variable]) / name
    spec = importlib.util.find_spec(name)
    if spec and spec.origin:
        return pathlib.Path(spec.origin).parent
    unpacked = SOURCES / f"{name}-{version}" / name
    return unpacked if unpacked.is_dir() else None
