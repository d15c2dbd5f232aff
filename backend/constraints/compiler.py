"""Constraint -> llguidance grammar -> compiled matcher, with a bounded LRU cache.

A constraint is only accepted once its matcher has been built under explicit
llguidance limits and has computed its first mask: a grammar with an empty
language, or one past the limits, is refused before any token is generated.
Copies of one compiled matcher share llguidance's lexer state, so a compiled
constraint whose matcher failed is dropped from the cache (`mark_failed`).
Whether its matchers can take tokens back (`rolls_back`), which checking
speculated tokens needs, is found once here too.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from backend.constraints.limits import ConstraintLimits
from backend.constraints.spec import ConstraintSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in llguidance's stub only

# Whitespace JSON allows between tokens, when the caller opts into it.
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]"


MAX_JSON_DEPTH = 100
"""Deepest JSON nesting accepted in a schema (llguidance's own parser stops at 128)."""


class ConstraintError(ValueError):
    """The constraint is malformed or asks for something llguidance cannot enforce."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        """The constraint kind (json_schema, regex, ...), naming the field at fault."""


def estimated_bytes(spec: ConstraintSpec) -> int:
    """What a compiled constraint holds in memory, estimated from its source's size.

    llguidance does not report it; measured here (RSS after compiling JSON schemas of 6 kB to
    660 kB), it grows by 100-150 bytes per byte of schema: 128 per byte plus a fixed share.
    """
    return 128 * source_chars(spec) + (256 << 10)


def source_chars(spec: ConstraintSpec) -> int:
    return sum(map(len, spec.value)) if isinstance(spec.value, tuple) else len(spec.value)


def source_text(spec: ConstraintSpec) -> str:
    """The one text of a constraint of any kind but choice (a schema, a regex, a grammar)."""
    if not isinstance(spec.value, str):
        raise ConstraintError(f"{spec.kind} takes one text, not a list")
    return spec.value


class _Health:
    """Whether any matcher copied from one compiled constraint has failed (shared, so mutable)."""

    def __init__(self) -> None:
        self.failed = False


@dataclass(frozen=True)
class CompileReport:
    """What a caller learns of its constraint's compile: plain values, as they cross to another process."""

    cached: bool
    compile_s: float
    warnings: tuple[str, ...] = ()

    @property
    def fresh_compile_s(self) -> float:
        """The compile time a request using this paid: none when it came from the cache."""
        return 0.0 if self.cached else self.compile_s


@dataclass(frozen=True)
class CompiledConstraint:
    spec: ConstraintSpec
    template: llguidance.LLMatcher
    compile_s: float
    cached: bool
    warnings: tuple[str, ...]
    rolls_back: bool
    """Its matchers can take consumed tokens back, as checking proposed tokens does (see `_rolls_back`):
    a sequence under a constraint that cannot is never given proposals."""
    health: _Health = dataclasses.field(default_factory=_Health)
    size_bytes: int = 0
    """Estimated memory held (see `estimated_bytes`)."""

    def report(self) -> CompileReport:
        return CompileReport(self.cached, self.compile_s, self.warnings)

    def mark_failed(self) -> None:
        """A matcher of this constraint failed: no later request may inherit its shared state."""
        self.health.failed = True

    @property
    def fresh_compile_s(self) -> float:
        """The compile time a request using this paid: none when it came from the cache."""
        return 0.0 if self.cached else self.compile_s

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (a copy; compiling is not repeated)."""
        return self.template.deep_copy()


def to_grammar(spec: ConstraintSpec) -> str:
    """Turns a constraint into an llguidance grammar string. Raises ConstraintError."""
    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_object":
            schema = {"type": "object"}
        else:
            text = source_text(spec)
            if json_depth(text) > MAX_JSON_DEPTH:
                raise ConstraintError(f"json_schema nests deeper than {MAX_JSON_DEPTH} levels")
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("json_schema must be a JSON object (or true/false)")
        options: JsonCompileOptions = {"whitespace_flexible": spec.whitespace_flexible}
        if spec.max_whitespace is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": f"{_JSON_WHITESPACE}{{0,{spec.max_whitespace}}}"}
        if not spec.strict:
            options["lenient"] = options["coerce_one_of"] = True
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    if spec.kind == "regex":
        pattern = source_text(spec)
        if _ends_in_lone_backslash(pattern):  # llguidance would silently drop it
            raise ConstraintError("the regex ends in an unfinished escape (a lone backslash)")
        return llguidance.LLMatcher.grammar_from_regex(pattern)
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(source_text(spec))
    if spec.kind == "composed":  # built by the service from checked parts (tools, reasoning): llguidance's own form
        return source_text(spec)
    if spec.kind == "choice":
        # Lark string literals take JSON's escapes, so every choice is matched byte for byte.
        alternatives = " | ".join(json.dumps(value, ensure_ascii=False) for value in spec.value)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    raise ConstraintError(f"unknown constraint kind {spec.kind!r}")


def json_depth(text: str) -> int:
    """How deep the brackets of a JSON text nest (strings skipped), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _ends_in_lone_backslash(regex: str) -> bool:
    trailing = len(regex) - len(regex.rstrip("\\"))
    return trailing % 2 == 1


class ConstraintCompiler:
    """Compiles constraints for one tokenizer. Thread-safe; compiling releases the GIL."""

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, cache_size: int = 256, limits: ConstraintLimits = ConstraintLimits()
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._parser_limits = limits.parser_limits()
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[ConstraintSpec, CompiledConstraint] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """The estimated memory of the cached constraints (at most 256 of them: cheap to add up)."""
        return sum(compiled.size_bytes for compiled in self._cache.values())

    def cached(self, spec: ConstraintSpec) -> CompiledConstraint | None:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None and compiled.health.failed:
                del self._cache[spec]
                compiled = None
            if compiled is not None:
                self._cache.move_to_end(spec)
                return dataclasses.replace(compiled, cached=True)
        return None

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Returns the cached compilation or compiles now. Raises ConstraintError."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        start = time.perf_counter()
        try:
            grammar = to_grammar(spec)
        except ConstraintError as exc:
            raise ConstraintError(str(exc), spec.kind) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._parser_limits)
        problem = matcher.get_error() or _first_step_problem(matcher.deep_copy())
        if problem:
            raise ConstraintError(llguidance_message(problem), spec.kind)
        compiled = CompiledConstraint(
            spec, matcher, time.perf_counter() - start, False, tuple(matcher.get_grammar_warnings()),
            _rolls_back(matcher.deep_copy(), self.tokenizer.eos_tokens), size_bytes=estimated_bytes(spec),
        )
        with self._lock:
            self._cache.pop(spec, None)  # compiled twice at once: keep the newer
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size or self.cached_bytes > self.limits.cache_bytes:
                self._cache.popitem(last=False)
        return compiled


_EMPTY_LANGUAGE = "the constraint allows no output at all (its language is empty)"


def llguidance_message(error: str) -> str:
    """llguidance's error as a caller should read it (its terse mode appends a marker)."""
    message = error.replace("<non-verbose/>", "").strip()
    if message == "NoExtensionBias":  # no token can start a sentence
        return _EMPTY_LANGUAGE
    return message


def _first_step_problem(probe: llguidance.LLMatcher) -> str:
    """Why a fresh matcher cannot take its first step, or "".

    Computing the first mask and the forced tokens runs the lexer and parser once, under the
    limits, so a grammar past them or with no sentence at all fails here, not mid-stream.
    """
    mask = probe.compute_bitmask()
    if not probe.is_error() and not any(mask) and not probe.is_accepting():
        return _EMPTY_LANGUAGE
    forced = probe.compute_ff_tokens()
    if not probe.is_error() and forced:
        probe.consume_tokens(forced)
    return probe.get_error()


def _rolls_back(probe: llguidance.LLMatcher, eos_tokens: list[int]) -> bool:
    """Whether the grammar's matchers can take a consumed token back.

    llguidance refuses every rollback in a grammar any of whose rules has stop= or max_tokens= (a reasoning
    block's, or a caller's Lark), and puts the matcher in error; rollback(0) succeeds even there, so the
    probe takes one allowed token (text where any is allowed, as proposals are) and gives it back.
    """
    allowed = np.flatnonzero(np.unpackbits(np.frombuffer(probe.compute_bitmask(), dtype=np.uint8), bitorder="little"))
    text = np.setdiff1d(allowed, eos_tokens)
    choices = text if len(text) else allowed
    if not len(choices):  # cannot happen past _first_step_problem; not knowing, claim nothing
        return False
    probe.consume_token(int(choices[0]))
    return probe.rollback(1) and not probe.is_error()
