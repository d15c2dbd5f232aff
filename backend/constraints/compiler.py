"""Constraint -> llguidance grammar -> compiled matcher, with a bounded LRU cache."""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass

import llguidance

from backend.types import ConstraintSpec

# Whitespace JSON allows between tokens, when the caller opts into it.
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]"


class ConstraintError(ValueError):
    """The constraint is malformed or asks for something llguidance cannot enforce."""


@dataclass(frozen=True)
class CompiledConstraint:
    spec: ConstraintSpec
    template: llguidance.LLMatcher
    compile_s: float
    cached: bool
    warnings: tuple[str, ...]

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
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("json_schema must be a JSON object (or true/false)")
        options: dict = {"whitespace_flexible": spec.whitespace_flexible}
        if spec.max_whitespace is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": f"{_JSON_WHITESPACE}{{0,{spec.max_whitespace}}}"}
        if not spec.strict:
            options.update(lenient=True, coerce_one_of=True)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    if spec.kind == "choice":
        # Lark string literals take JSON's escapes, so every choice is matched byte for byte.
        alternatives = " | ".join(json.dumps(value, ensure_ascii=False) for value in spec.value)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    raise ConstraintError(f"unknown constraint kind {spec.kind!r}")


class ConstraintCompiler:
    """Compiles constraints for one tokenizer. Thread-safe; compiling releases the GIL."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[ConstraintSpec, CompiledConstraint] = collections.OrderedDict()
        self._lock = threading.Lock()

    def cached(self, spec: ConstraintSpec) -> CompiledConstraint | None:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return CompiledConstraint(spec, compiled.template, compiled.compile_s, True, compiled.warnings)
        return None

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Returns the cached compilation or compiles now. Raises ConstraintError."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        start = time.perf_counter()
        grammar = to_grammar(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(matcher.get_error())
        compiled = CompiledConstraint(
            spec, matcher, time.perf_counter() - start, False, tuple(matcher.get_grammar_warnings())
        )
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled
