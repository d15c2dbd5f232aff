"""The grammar filter for exllama jobs, as a pure core on ints and numpy arrays.

Both generations call a job's filter from their worker threads, and an exception
there ends every job in the generator, so nothing here raises: a matcher
error puts the filter in an error state in which only EOS is allowed, and
JobResults reports the error on that stream. The filter class each generator
sees is a thin shell over this, in its binding (exllamav2's masks logits in place,
exllamav3's hands over the packed bitmask).
"""

from __future__ import annotations

import time

import llguidance.numpy
import numpy as np

from backend.constraints import CompiledConstraint, apply_bitmask
from backend.constraints.compiler import llguidance_message


class GrammarFilterCore:
    def __init__(self, compiled: CompiledConstraint, eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        """`vocab_size` is the tokenizer's; the logits may be wider (padding is always masked)."""
        self._compiled = compiled
        self._matcher = compiled.new_matcher()
        self._eos = np.array(eos_token_ids, dtype=np.int64)
        self._vocab_size = vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self.error = ""
        self.mask_s = 0.0
        """Time spent computing masks (on the generator's filter threads)."""

    def begin(self) -> None:
        self._matcher = self._compiled.new_matcher()
        self.error = ""

    def feed(self, token_id: int) -> None:
        if self.error:
            return
        if not self._matcher.consume_token(token_id):
            self._failed(self._matcher.get_error() or f"token {token_id} rejected by the constraint")

    def _failed(self, error: str) -> None:
        self.error = llguidance_message(error) or "the constraint failed"
        self._compiled.mark_failed()  # its copies share lexer state: no later job may inherit it

    @property
    def complete(self) -> bool:
        """The output is a whole sentence and nothing more can follow (never after an error)."""
        return not self.error and self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def satisfied(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return not self.error and (self._matcher.is_accepting() or self._matcher.is_stopped())

    def prepare_mask(self) -> bool:
        """Computes the next mask (GIL released inside llguidance); True, as exllamav2 asserts."""
        start = time.perf_counter()
        try:
            if not self.error and not self.complete:
                llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
                if not self._matcher.is_error():  # an error inside llguidance comes back as an EOS-only mask
                    return True
                self._failed(self._matcher.get_error())
        except Exception as exc:  # never let it reach the generator's iterate()
            self._failed(f"mask computation failed: {exc}")
        finally:
            self.mask_s += time.perf_counter() - start
        self._eos_only()
        return True

    @property
    def bitmask(self) -> np.ndarray:
        """The mask `prepare_mask` computed, packed: int32 words of shape (1, ceil(vocabulary / 32)), bit
        (i & 31) of word (i >> 5) set where token i is allowed (llguidance's layout, and exllamav3's)."""
        return self._bitmask

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """Sets disallowed logits (and any padding past the vocabulary) to -inf, in place."""
        apply_bitmask(logits, self._bitmask[0])
        return logits

    def allowed_tokens(self) -> tuple[list[int], list[int]]:
        """The allowed-list path: (pass tokens, end tokens); never an empty pass list."""
        self.prepare_mask()
        allowed = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little", count=self._vocab_size)
        tokens = np.flatnonzero(allowed).tolist()
        return (tokens or self._eos.tolist()), []

    def _eos_only(self) -> None:
        bits = np.zeros(self._bitmask.shape[1] * 32, dtype=np.uint8)
        bits[self._eos] = 1
        self._bitmask[0] = np.packbits(bits, bitorder="little").view(np.int32)
