"""Which rows of a prompt llama.cpp computes together: decided from the prompt alone.

llama.cpp does not round a token the same way in every batch. Its CPU flash
attention computes a group of TILE_ROWS or more query rows of one sequence
tiled and a smaller group row by row, and a row computed alone takes other
kernels again (measured: docs/benchmarks.md). So that greedy output never
depends on what is cached or on what else runs, every prompt has one layout:

- rows before `tiled_until` go in groups of at least TILE_ROWS;
- the rest in groups of 2 to TILE_ROWS - 1;
- each group in a llama_decode of its own (a batch mixing sequences would be
  split into equal pieces per sequence, regrouping the rows).

`tiled_until` sits at the start of a chat's last message when it has one, so a
later request with the same history reuses everything before its own question;
from there (or from the start of a plain prompt, or of a chat whose history is
shorter than a tile) it advances in whole tiles, leaving the last 2 to
TILE_ROWS + 1 rows for the small groups. Cached rows are reused as far as they
were computed in the mode the new layout asks for.

That is the guarantee `prefix_cache_exact` asks for. Without it (the default,
as llama-server, vLLM and SGLang reuse) a layout is `free`: a prompt goes in
groups as large as a batch takes, and cached rows are reused to the token, but
for the last one, whose logits the first token is drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_ROWS = 64  # ggml's CPU flash attention query tile (GGML_FA_TILE_Q)
MIN_GROUP = 2  # a prompt row is never computed alone


@dataclass(frozen=True)
class PromptLayout:
    length: int
    tiled_until: int
    free: bool = False
    """No grouping to keep (prefix_cache_exact off): groups as large as a batch takes, reuse to the token."""

    @classmethod
    def of(cls, length: int, last_message_start: int, batch_tokens: int, exact: bool = True) -> PromptLayout:
        if not exact:
            return cls(length, 0, free=True)
        if batch_tokens < 2 * TILE_ROWS:  # tiled groups could not always be formed
            return cls(length, 0)
        start, last_message = 0, length - last_message_start
        if last_message_start and MIN_GROUP <= last_message:
            if last_message_start >= TILE_ROWS:
                start = last_message_start
            elif last_message <= TILE_ROWS + 1:  # a short history and message: small groups throughout
                return cls(length, 0)
        return cls(length, start + TILE_ROWS * max(0, (length - start - MIN_GROUP) // TILE_ROWS))

    def next_group(self, cached: int, batch_tokens: int) -> int:
        """How many rows, from `cached`, the next llama_decode of this prompt takes."""
        if self.free:
            return min(self.length - cached, batch_tokens)
        if cached < self.tiled_until:
            left = self.tiled_until - cached  # TILE_ROWS or more (see reusable)
            if left <= batch_tokens:
                return left
            return batch_tokens if left - batch_tokens >= TILE_ROWS else left - TILE_ROWS
        left = self.length - cached
        group = min(left, TILE_ROWS - 1, batch_tokens)
        return group - 1 if left - group == 1 and group > MIN_GROUP else group

    def reusable(self, common: int, cached_tiled_until: int) -> int:
        """How many of `common` cached rows, computed with a layout tiled until
        `cached_tiled_until`, this prompt takes as they are."""
        if self.free:
            return max(0, min(common, self.length - 1))
        rows = common if cached_tiled_until == self.tiled_until else min(common, cached_tiled_until, self.tiled_until)
        rows = max(0, min(rows, self.length - MIN_GROUP))
        if rows < self.tiled_until and self.tiled_until - rows < TILE_ROWS:
            rows = self.tiled_until - TILE_ROWS  # the tile's rows go again, computed as a group
        return rows
