"""Where cells live: llama.cpp sequence ids ("slots", one cache stream each), and every call that moves them.

A running sequence holds one slot. A slot no one holds keeps the cells of the
last sequence that used it, indexed by token (see PrefixIndex), so a new prompt
starts from the longest prefix of its own salt any slot holds that its layout
can take: used in place, or copied across streams and trimmed. A sequence that
ends leaves every token it has: as decoded (the default, reused to the token),
or with prefix_cache_exact its generated tail to be computed again as prompt
rows (see backend.llamacpp.retile). A sequence whose prefix a neighbour is
computing right now waits a step or two and copies it. Idle prefixes live only
in free slots, so they never block a live request; when a slot must be
overwritten, the least recently used prefix goes first.

llama.cpp's per-sequence cache is fast only while a batch's sequences have
ascending, contiguous ids: new sequences take a slot that keeps them so, and
`compact` closes a gap left by one that ended, one move per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable

import llama_cpp

from backend.common.tokens import common_prefix
from backend.config import LlamaCppSettings
from backend.llamacpp.layout import MIN_GROUP, TILE_ROWS
from backend.llamacpp.prefix_cache import PrefixIndex
from backend.llamacpp.sequence import Placement, Sequence

# With prefix_cache_exact, shorter shared prefixes are computed again: copying a cache stream costs about as much.
MIN_REUSE_TOKENS = 16
# To the token, a prefix in another stream is copied when it saves this many rows (a copy of a 2,048-cell
# stream of the embedded model takes about what 2 prompt rows do on 2 cores: docs/benchmarks.md); a prefix
# taken in place costs nothing, however short.
MIN_COPY_TOKENS = 4
# A sequence back from preemption takes its own cells as they are, but for its last 2 tokens:
# llama.cpp computes a token alone with other kernels than several (see backend.llamacpp.layout).
RECOMPUTED_TAIL = 2


class Slots:
    def __init__(self, memory: llama_cpp.llama_memory_t, count: int, settings: LlamaCppSettings, context_length: int) -> None:
        self._memory = memory
        self.count = count
        self._free = list(range(count))  # a heap: the lowest slot goes first
        self._prefix_cache = settings.prefix_cache
        self._context_length = context_length
        self.exact = settings.prefix_cache_exact
        """prefix_cache_exact: only cells computed as a cold prompt computes them are shared (see PrefixIndex)."""
        self._keep_generated = settings.prefix_cache and settings.prefix_cache_generated and (
            not self.exact or settings.batch_tokens >= 2 * TILE_ROWS)  # tiles to compute answers again in
        """Ended sequences leave their generated cells shared: as decoded, or (exact) their tail to be computed
        again as prompt rows by backend.llamacpp.retile."""
        self.prefixes = PrefixIndex()
        """What free slots still hold."""

    # -- placing and leaving -------------------------------------------------------

    def place(self, seq: Sequence, running: Collection[Sequence]) -> int | None:
        """Gives a sequence a free slot (see _pick_slot), taking in place the prefix that slot holds if it is
        the best; returns how many prompt tokens it took so (None: it still looks, see take_prefixes)."""
        source, shared = self._best_prefix(seq, running)
        slot = self._pick_slot(source, running, self._in_place(seq, source, shared))
        self._free.remove(slot)
        heapq.heapify(self._free)
        seq.place = Placement(slot, cached=0, needs_prefix=True)
        if source == slot:
            self._reuse(seq, slot, shared)
            self.prefixes.drop(slot)
            return shared
        if slot in self.prefixes:
            self._clear_for_reuse(slot)
            llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
        return None

    def fork(self, source: Sequence, seq: Sequence, running: Collection[Sequence]) -> None:
        """Gives a sequence a free slot holding a copy of `source`'s cells: another sample of the prompt
        `source` has just computed (see backend.llamacpp.siblings)."""
        slot = self._pick_slot(None, running)
        self._free.remove(slot)
        heapq.heapify(self._free)
        self._clear_for_reuse(slot)
        llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._memory, source.slot, slot, -1, -1)
        seq.place = Placement(slot, cached=source.cached)

    def vacate(self, seq: Sequence, returning: bool = False) -> None:
        """Takes a sequence off its slot, leaving its cells there as a cached prefix when worth keeping;
        `returning`: it was preempted, and its cells are kept over others' until it comes back."""
        worth = MIN_REUSE_TOKENS if self.exact else 1
        if self._prefix_cache and (seq.cached >= worth or returning and seq.cached > RECOMPUTED_TAIL):
            if not self.exact:  # to the token: every cell as it is
                self.prefixes.put(seq.slot, seq.tokens[: seq.cached], seq.id, self.offered(seq), 0, returning, seq.cache_salt)
                return self._free_slot(seq)
            # A chat's: its next turn lays out this history predictably (see backend.llamacpp.retile).
            generated = (not returning and self._keep_generated and bool(seq.request.turn_end)
                         and len(seq.tokens) > seq.prompt_length)
            ended = self._ended_with(seq) if generated else []
            if len(ended) >= TILE_ROWS and seq.layout.tiled_until == 0:
                self._keep_small_prompt(seq)
            self.prefixes.put(seq.slot, seq.tokens[: seq.cached], seq.id, seq.prompt_length, seq.layout.tiled_until,
                              returning, seq.cache_salt, ended)
        else:
            llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
        self._free_slot(seq)

    def _free_slot(self, seq: Sequence) -> None:
        heapq.heappush(self._free, seq.slot)
        seq.place = Placement()

    def release(self, seq: Sequence) -> None:
        """A sequence ended: off its slot (see vacate), or, preempted, the cells kept for it free to go."""
        if seq.placed:
            self.vacate(seq)
        elif seq.turn.admissions:
            self.prefixes.settle(seq.id)

    def comeback_cost(self, seq: Sequence) -> int:
        """The tokens a sequence preempted now would compute again when it comes back: its last few if its
        cells are worth keeping and a free slot can hold them beside those of the others preempted, else all."""
        room = len(self._free) > self.prefixes.returning
        return RECOMPUTED_TAIL if self._prefix_cache and room and seq.cached > RECOMPUTED_TAIL else len(seq.tokens)

    # -- generated tails (see backend.llamacpp.retile) -------------------------------------

    def start_retile(self, slot: int, tiled: bool) -> tuple[int, tuple[int, ...]]:
        """For the entry at `slot` whose sequence ended: the first row to compute again as a prompt row
        and every token it ended with, its cells from that row dropped. The rows computed as a prompt
        in the mode asked for (`tiled`, else small groups) stay, but for enough to make a group."""
        entry = self.prefixes.get(slot)
        assert entry is not None and entry.ended_with
        length = len(entry.ended_with)
        if tiled:
            start = max(0, min(entry.tiled_until, length - TILE_ROWS))
        else:
            start = max(0, min(entry.shared if entry.tiled_until == 0 else 0, length - MIN_GROUP))
        llama_cpp.llama_memory_seq_rm(self._memory, slot, start, -1)
        return start, entry.ended_with

    def _keep_small_prompt(self, seq: Sequence) -> None:
        """A prompt shorter than a tile was computed in small groups, as the next chat with the same short
        history computes it; its answer goes tiled (the next turn's history is longer than a tile). A copy
        of the prompt's cells stays in a free slot for those other chats: an empty one, else the least recently
        used entry's (this prompt was used last; without the copy, no short prompt could take its cells)."""
        spare = self.prefixes.victim(self._free)
        if spare is None or (held := self.prefixes.get(spare)) is not None and held.returning:
            return  # a preempted sequence's cells are kept for its return
        if self.prefixes.drop(spare) is not None:
            llama_cpp.llama_memory_seq_rm(self._memory, spare, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._memory, seq.slot, spare, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, spare, seq.prompt_length, -1)
        self.prefixes.put(spare, seq.tokens[: seq.prompt_length], seq.id, seq.prompt_length, 0, cache_salt=seq.cache_salt)

    def _ended_with(self, seq: Sequence) -> list[int]:
        """Every token the sequence has, then what its chat's template writes after an answer (the next
        turn's rendering has it too), as far as the context holds."""
        ending = seq.request.turn_end
        written = next((k for k in range(min(len(ending), len(seq.tokens)), 0, -1)
                        if tuple(seq.tokens[-k:]) == ending[:k]), 0)  # the closing token it sampled itself
        return [*seq.tokens, *ending[written:]][: self._context_length]

    def retiled(self, slot: int, tokens: tuple[int, ...], tiled_until: int) -> None:
        """Every cell at `slot` is prompt-computed now, tiled before `tiled_until`: the whole entry is shared."""
        entry = self.prefixes.get(slot)
        assert entry is not None
        self.prefixes.put(slot, tokens, entry.owner, len(tokens), tiled_until, cache_salt=entry.cache_salt)

    def forget(self, slot: int) -> None:
        """The entry at `slot` could not be completed: its cells and entry go."""
        llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self.prefixes.drop(slot)

    def keep_cells(self, seq: Sequence, upto: int) -> None:
        """Keeps only the sequence's cells before position `upto`: rows it fed ahead that were not accepted go."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, upto, -1)
        seq.place.cached = upto

    def advance(self, seq: Sequence, count: int) -> None:
        """The sequence's next `count` tokens are fed into its cells (llama_decode computes them this step)."""
        seq.place.cached += count

    def _pick_slot(self, source: int | None, running: Collection[Sequence], in_place: bool = False) -> int:
        """`source` when its prefix is taken in place wherever the slot lies (compact closes the gap it may leave);
        else a free slot that keeps the live sequences contiguous (a hole between them, else one beside
        them); among those, the one holding the best prefix, else an empty one, else the least
        recently used prefix's."""
        if in_place and source is not None:
            return source
        live = [seq.slot for seq in running if seq.placed]
        candidates = self._free
        if live:
            low, high = min(live), max(live)
            holes = [slot for slot in self._free if low < slot < high]
            beside = [slot for slot in self._free if slot in (low - 1, high + 1)]
            candidates = holes or beside or self._free
        if self.exact and source in candidates and source in self.prefixes:
            return source
        slot = self.prefixes.victim(candidates)
        assert slot is not None, "a sequence is placed only while a slot is free"  # so victim has candidates
        return slot

    # -- prefix reuse ----------------------------------------------------------------

    def take_prefixes(self, running: Collection[Sequence]) -> list[tuple[Sequence, int]]:
        """Each newly placed sequence starts from the best cached prefix, unless a neighbour is computing a
        longer one; returns (sequence, prompt tokens it took) for those that are done looking."""
        taken = []
        for seq in sorted((s for s in running if s.place.needs_prefix), key=lambda s: s.slot):
            source, shared = self._best_prefix(seq, running, copying=True)
            if self._computing_longer_prefix(seq, shared, running):
                continue  # copy it once computed, a step or two from now
            if source is None:
                seq.place.needs_prefix = False
            else:
                self._reuse(seq, source, shared)
            taken.append((seq, shared if source is not None else 0))
        return taken

    def offered(self, seq: Sequence) -> int:
        """The cells of a placed sequence that other requests of its salt may take: its prompt's, and (to the token,
        with prefix_cache_generated) those it has generated too."""
        if not seq.placed or seq.place.needs_prefix:
            return 0
        return seq.cached if self._keep_generated and not self.exact else min(seq.cached, seq.prompt_length)

    def _in_place(self, seq: Sequence, source: int | None, shared: int) -> bool:
        """To the token, a free slot's prefix is taken there when the prompt keeps at least half of what it offers
        (else it is copied, and the entry stays for others), unless it waits for another preempted sequence."""
        entry = self.prefixes.get(source) if source is not None and not self.exact else None
        if entry is None or entry.returning and entry.owner != seq.id:
            return False
        return entry.owner == seq.id or 2 * shared >= len(entry.offered)

    def _best_prefix(self, seq: Sequence, running: Iterable[Sequence], copying: bool = False) -> tuple[int | None, int]:
        """The slot holding the most reusable computed prefix of the sequence's tokens (idle or live), and its length,
        if it is worth taking (`copying`: into another stream). None for one that asked for prompt logprobs: cached
        rows have no logits, so it computes them all."""
        if not self._prefix_cache or seq.request.prompt_logprobs >= 0:
            return None, 0
        candidates = list(self.prefixes.matches(seq.tokens, seq.id, seq.cache_salt))
        for other in running:  # a live sequence's shared cells (see offered)
            if other is not seq and other.cache_salt == seq.cache_salt and (computed := self.offered(other)):
                common = common_prefix(other.tokens[:computed], seq.tokens)
                candidates.append((other.slot, common, other.layout.tiled_until))
        best: tuple[int | None, int] = (None, 0)
        own = False
        for slot, common, tiled_until in candidates:
            entry = self.prefixes.get(slot) if tiled_until is None else None
            mine = entry is not None and entry.owner == seq.id
            rows = _reusable(seq, common, tiled_until, mine)
            if rows > best[1]:
                best, own = (slot, rows), mine
        # Its own cells save a preempted sequence replaying its output one token a step: worth a copy at any length.
        floor = 1 if own else MIN_REUSE_TOKENS if self.exact else MIN_COPY_TOKENS if copying else 1
        return best if best[1] >= floor else (None, 0)

    def _computing_longer_prefix(self, seq: Sequence, available: int, running: Iterable[Sequence]) -> bool:
        if not self._prefix_cache or seq.request.prompt_logprobs >= 0:
            return False
        for other in running:
            if other is seq or other.place.needs_prefix or other.paused or not other.prefilling or not other.placed:
                continue
            if other.cache_salt != seq.cache_salt:
                continue
            common = common_prefix(other.tokens[: other.prompt_length], seq.tokens)
            if _reusable(seq, common, other.layout.tiled_until) >= available + MIN_REUSE_TOKENS:
                return True
        return False

    def _reuse(self, seq: Sequence, source: int, shared: int) -> None:
        """Copies `source`'s cache stream into the sequence's slot (llama.cpp copies it before the next
        decode) and trims it to the shared prefix."""
        if source != seq.slot:
            llama_cpp.llama_memory_seq_cp(self._memory, source, seq.slot, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, shared, -1)
        if source in self.prefixes:
            self.prefixes.touch(source)
        self.prefixes.settle(seq.id)
        seq.place.cached, seq.place.needs_prefix = shared, False

    # -- keeping decoding sequences contiguous -------------------------------------------

    def compact(self, running: Collection[Sequence]) -> None:
        """Keeps the decoding sequences on contiguous slots, one move per step.

        llama.cpp's per-sequence cache decodes a batch whose ids have a gap (left by a finished
        or paused sequence) 22% slower at 8 sequences. Moving the highest decoding sequence into
        the lowest hole copies one cache stream (a few milliseconds) and removes the gap. Where
        the run starts does not matter: slots below it may hold cached prefixes.
        """
        decoding = sorted((seq for seq in running if seq.placed and not seq.paused), key=lambda seq: seq.slot)
        if not decoding:
            return
        top = decoding[-1]
        taken = {seq.slot for seq in decoding}
        hole = next((slot for slot in range(decoding[0].slot, top.slot) if slot not in taken), None)
        if hole is None:
            return
        parked = next((seq for seq in running if seq.slot == hole), None)
        if parked is None:
            self._move(top, hole)
        elif self._free and max(self._free) > top.slot:
            self._move(parked, max(self._free))  # a paused sequence waits above the decoding ones

    def _move(self, seq: Sequence, slot: int) -> None:
        """Moves a sequence's cache to a free slot; llama.cpp copies the stream before the next decode."""
        self._free.remove(slot)
        self._clear_for_reuse(slot)
        llama_cpp.llama_memory_seq_cp(self._memory, seq.slot, slot, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, -1, -1)
        self._free.append(seq.slot)
        heapq.heapify(self._free)
        seq.place.slot = slot

    def _clear_for_reuse(self, slot: int) -> None:
        """A slot taken out of the free list is about to be overwritten: its cached prefix, if any,
        moves to a free slot holding nothing or an older prefix, or is given up."""
        if slot not in self.prefixes:
            return
        target = self.prefixes.victim(self._free, keep_newer_than=slot)
        if target is None:
            self.prefixes.drop(slot)
            return
        self.prefixes.drop(target)
        llama_cpp.llama_memory_seq_cp(self._memory, slot, target, -1, -1)
        self.prefixes.move(slot, target)


def _reusable(seq: Sequence, common: int, tiled_until: int | None, own: bool = False) -> int:
    """Rows of `common` cached ones the sequence takes: as they are (tiled_until None: its own, or a decoded
    answer it continues) but for the last RECOMPUTED_TAIL, else as far as its prompt layout allows; its own
    prompt rows it takes as far as its layout allows too."""
    if tiled_until is not None:
        return seq.layout.reusable(common, tiled_until)
    rows = min(common, len(seq.tokens) - RECOMPUTED_TAIL)
    return seq.layout.reusable(rows, seq.layout.tiled_until) if own and rows < seq.prompt_length else rows
