"""Paged attention for exllamav2 on torch's scaled_dot_product_attention.

exllamav2 0.3.2 runs its paged generator (continuous batching, shared prefix pages) only when a
flash_attn >= 2.5.7 provides `flash_attn_with_kvcache(..., block_table=...)`. This module provides the
three functions exllamav2 calls on one GPU, with flash-attn 2.8.3's signatures and semantics:

* `flash_attn_func`: dense (B, L, H, D) attention; causal is aligned bottom-right when Lk != Lq.
* `flash_attn_varlen_func`: the same over packed segments given by cumulative lengths.
* `flash_attn_with_kvcache`: appends new K/V in place through the block table, gathers each
  sequence's pages and attends over them, every sequence of the batch in one SDPA call.

Also: grouped-query attention (query head h reads kv head h // (Hq / Hkv)), sliding windows and
tanh softcapping. Rows that have no key to attend to return zeros, as flash-attn's do.

What it does not prove: flash-attn's kernels or their speed. A kvcache call copies the pages its
block table lists (O(context) memory per layer, repeated per query head group under GQA) and masks
what lies past each sequence; tokens per second measured with this provider say nothing about flash-attn. Rotary,
ALiBi, cache_batch_idx, cache_leftpad, dropout and the softmax
LSE are not implemented (exllamav2 passes none of them on one GPU) and raise NotImplementedError.
`stats` counts the calls so that a GPU check can show that batched paged calls happened.
`kvcache_call` (checks, in-place append, counting) is shared with backend.exllamav2.paged_attention_triton,
the `triton` setting's flash_attn_with_kvcache, which reads the pages through the block table instead.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

NO_WINDOW: tuple[int, int] = (-1, -1)


@dataclasses.dataclass
class ProviderStats:
    """Counts kept by the three entry points; plain ints, so updating them costs no device sync."""

    calls: int = 0
    """Calls of any of the three functions."""
    kvcache_calls: int = 0
    paged_calls: int = 0
    """flash_attn_with_kvcache calls that went through a block table."""
    largest_kvcache_batch: int = 0
    """The most sequences attended in one flash_attn_with_kvcache call: >= 2 means real batching."""
    appended_tokens: int = 0
    """K/V rows written into caches (batch size times new tokens, summed over calls)."""

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)


stats = ProviderStats()


def flash_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, return_attn_probs: bool = False,
) -> torch.Tensor:
    """Attention of q (B, Lq, Hq, D) over k, v (B, Lk, Hkv, D); returns (B, Lq, Hq, D), contiguous."""
    _refuse(dropout_p=bool(dropout_p), alibi_slopes=alibi_slopes is not None, return_attn_probs=return_attn_probs)
    stats.calls += 1
    batch, device = q.shape[0], q.device
    q_lens = torch.full((batch,), q.shape[1], dtype=torch.long, device=device)
    k_lens = torch.full((batch,), k.shape[1], dtype=torch.long, device=device)
    return _attend(q, k, v, q_lens, k_lens, softmax_scale, causal, window_size, softcap)


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed segments: q (total_q, Hq, D), k, v (total_k, Hkv, D); segment b is
    rows cu_seqlens[b] .. cu_seqlens[b + 1]. Returns (total_q, Hq, D)."""
    _refuse(dropout_p=bool(dropout_p), alibi_slopes=alibi_slopes is not None,
            return_attn_probs=return_attn_probs, block_table=block_table is not None)
    stats.calls += 1
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.long)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.long)
    q_pad = _pad_segments(q, cu_q, max_seqlen_q)
    k_pad, v_pad = _pad_segments(k, cu_k, max_seqlen_k), _pad_segments(v, cu_k, max_seqlen_k)
    out = _attend(q_pad, k_pad, v_pad, cu_q.diff(), cu_k.diff(), softmax_scale, causal, window_size, softcap)
    return _unpad_segments(out, cu_q, q.shape[0])


def flash_attn_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
    v: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0, return_softmax_lse: bool = False,
) -> torch.Tensor:
    """Attention of q (B, Lq, Hq, D) over a KV cache, optionally appending k, v (B, Lnew, Hkv, D) first.

    With block_table (int32, (B, max_pages)) the caches are (num_pages, page_size, Hkv, D) and
    sequence b's position p lives in page block_table[b, p // page_size]; without it they are
    (B, max_len, Hkv, D). With k and v, cache_seqlens are the lengths before the append, the new rows
    are written in place at cache_seqlens[b] .. + Lnew, and each sequence attends over
    cache_seqlens[b] + Lnew keys. Without them cache_seqlens are the lengths to attend over.
    cache_seqlens may be an int or a (B,) tensor. Returns (B, Lq, Hq, D), contiguous.
    """
    call = kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                        cache_batch_idx, cache_leftpad, alibi_slopes, return_softmax_lse)
    key_slots = check_capacity(call.cache_seqlens, 0 if k is None else k.shape[1], k_cache, call.block_table)
    k_seq = _live_keys(k_cache, call.block_table, q.shape[0], key_slots)
    v_seq = _live_keys(v_cache, call.block_table, q.shape[0], key_slots)
    q_lens = torch.full((q.shape[0],), q.shape[1], dtype=torch.long, device=k_cache.device)
    return _attend(q, k_seq, v_seq, q_lens, call.key_lengths, softmax_scale, causal, window_size, softcap)


@dataclasses.dataclass(frozen=True)
class KvcacheCall:
    """A flash_attn_with_kvcache call's arguments once checked and its new K/V appended."""

    key_lengths: torch.Tensor
    """(B,) long, on the cache's device: the keys each sequence attends over, the appended ones included."""
    block_table: torch.Tensor | None
    """The block table as long, or None for a contiguous (B, max_len, Hkv, D) cache."""
    cache_seqlens: int | torch.Tensor
    """cache_seqlens as given (before the append), or the cache's length where none was."""


def kvcache_call(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    cache_seqlens: int | torch.Tensor | None, block_table: torch.Tensor | None, rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None, cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None, return_softmax_lse: bool,
) -> KvcacheCall:
    """What every provider of flash_attn_with_kvcache does before it attends: refuse what is not
    implemented, append k and v in place, count the call; the lengths to attend over."""
    _refuse(rotary=rotary_cos is not None or rotary_sin is not None, cache_batch_idx=cache_batch_idx is not None,
            cache_leftpad=cache_leftpad is not None, alibi_slopes=alibi_slopes is not None,
            return_softmax_lse=return_softmax_lse)
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v, or neither")
    batch, device = q.shape[0], k_cache.device
    if cache_seqlens is None:
        if block_table is not None or k is not None:
            raise ValueError("flash_attn_with_kvcache: cache_seqlens is needed with block_table or k/v")
        cache_seqlens = k_cache.shape[1]
    seqlens = _as_lengths(cache_seqlens, batch, device)
    if block_table is not None:
        block_table = block_table.to(device=device, dtype=torch.long)
    if k is not None and v is not None:  # both or neither, checked above
        _append(k_cache, v_cache, k, v, seqlens, block_table)
        seqlens = seqlens + k.shape[1]
    _count_kvcache_call(batch, k, paged=block_table is not None)
    return KvcacheCall(seqlens, block_table, cache_seqlens)


def _refuse(**asked_for: bool) -> None:
    """NotImplementedError for the flash-attn features this provider leaves out, when they are asked for."""
    for name, asked in asked_for.items():
        if asked:
            raise NotImplementedError(
                f"tokenspout's SDPA paged attention does not implement {name} (exllamav2 does not pass it on one GPU)"
            )


def _count_kvcache_call(batch: int, k: torch.Tensor | None, paged: bool) -> None:
    stats.calls += 1
    stats.kvcache_calls += 1
    stats.paged_calls += int(paged)
    stats.largest_kvcache_batch = max(stats.largest_kvcache_batch, batch)
    if k is not None:
        stats.appended_tokens += k.shape[0] * k.shape[1]


def _as_lengths(cache_seqlens: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.long, device=device)
    return cache_seqlens.to(device=device, dtype=torch.long).expand(batch)


def _append(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Writes k, v (B, Lnew, Hkv, D) into the caches at positions seqlens[b] .. + Lnew, in place."""
    batch, new = k.shape[:2]
    positions = seqlens[:, None] + torch.arange(new, device=seqlens.device)  # (B, Lnew)
    if block_table is None:
        rows = torch.arange(batch, device=seqlens.device)[:, None].expand(batch, new)
        index = (rows, positions)
    else:
        page_size = k_cache.shape[1]
        pages = torch.gather(block_table, 1, positions // page_size)
        index = (pages, positions % page_size)
    # index_put_ writes through the given view whatever its strides, so exllamav2's cache itself changes.
    k_cache.index_put_(index, k.to(k_cache.dtype))
    v_cache.index_put_(index, v.to(v_cache.dtype))


def check_capacity(
    cache_seqlens: int | torch.Tensor, new: int, k_cache: torch.Tensor, block_table: torch.Tensor | None
) -> int:
    """How many key positions to read per sequence (ValueError if the longest does not fit what the
    cache addresses): up to the longest sequence when the lengths are on
    the host, else all that the block table addresses. Reading device lengths would sync once per
    layer; exllamav2's table is only as wide as the batch's longest sequence (generator/dynamic.py:1143-1165),
    so the untrimmed read stays O(context)."""
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    longest = _host_longest(cache_seqlens)
    if longest is None:
        return capacity
    longest += new
    if longest > capacity:
        raise ValueError(f"a sequence of {longest} tokens does not fit the {capacity} positions the cache addresses")
    return longest


def _host_longest(cache_seqlens: int | torch.Tensor) -> int | None:
    """The longest length when it can be read without waiting for the device, else None."""
    if isinstance(cache_seqlens, int):
        return cache_seqlens
    if cache_seqlens.device.type == "cpu" and cache_seqlens.numel():
        return int(cache_seqlens.max())
    return None


def _live_keys(cache: torch.Tensor, block_table: torch.Tensor | None, batch: int, key_slots: int) -> torch.Tensor:
    """Positions 0 .. key_slots of every sequence, as (B, key_slots, Hkv, D); positions past a
    sequence's length (the rest of its last page, padding page 0) are masked in _attend."""
    if block_table is None:
        return cache[:batch, :key_slots]
    pages = block_table[:, : -(-key_slots // cache.shape[1])]
    return cache[pages].flatten(1, 2)[:, :key_slots]  # the gather copies: (B, pages * page_size, Hkv, D)


def _pad_segments(packed: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Packed (total, H, D) rows as (B, max_len, H, D); rows past a segment's end repeat valid
    data and are masked by the segment lengths."""
    offsets = cu_seqlens[:-1, None] + torch.arange(max_len, device=packed.device)
    return packed[offsets.clamp(max=max(packed.shape[0] - 1, 0))]


def _unpad_segments(padded: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    tokens = torch.arange(total, device=padded.device)
    segment = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    return padded[segment, tokens - cu_seqlens[segment]]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor, k_lens: torch.Tensor,
    softmax_scale: float | None, causal: bool, window_size: tuple[int, int], softcap: float,
) -> torch.Tensor:
    """q (B, Lq, Hq, D) over k, v (B, Lk, Hkv, D), where sequence b has q_lens[b] queries and
    k_lens[b] keys, its last query aligned with its last key. Returns (B, Lq, Hq, D), contiguous."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    allowed = _allowed(q.shape[1], k.shape[1], q_lens, k_lens, causal, window_size)  # (B, 1, Lq, Lk)
    has_key = allowed.any(dim=-1, keepdim=True)
    # A row with no key would be NaN in SDPA; let it see every key and zero it after, as flash-attn does.
    allowed = allowed | ~has_key
    k, v = _expand_kv_heads(k, q.shape[2]), _expand_kv_heads(v, q.shape[2])
    q_h, k_h, v_h = q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # SDPA's layout
    if softcap:
        out = _softcapped_attention(q_h, k_h, v_h, allowed, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=allowed, scale=scale)
    out = out.masked_fill(~has_key, 0.0)
    return out.transpose(1, 2).contiguous()


def _allowed(
    q_len: int, k_len: int, q_lens: torch.Tensor, k_lens: torch.Tensor, causal: bool, window_size: tuple[int, int]
) -> torch.Tensor:
    """Which key each query may read, (B, 1, Lq, Lk). Query i of sequence b sits at key position
    k_lens[b] - q_lens[b] + i (bottom-right alignment); window (left, right) is flash-attn's:
    keys from that position - left to that position + right, -1 meaning unbounded."""
    device = k_lens.device
    query = torch.arange(q_len, device=device)[None, :, None]
    key = torch.arange(k_len, device=device)[None, None, :]
    position = (k_lens - q_lens)[:, None, None] + query  # (B, Lq, 1)
    allowed = (key < k_lens[:, None, None]) & (query < q_lens[:, None, None])
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        allowed = allowed & (key <= position + right)
    if left >= 0:
        allowed = allowed & (key >= position - left)
    return allowed[:, None]


def _expand_kv_heads(kv: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Grouped-query attention: kv head j serves query heads j * ratio .. (j + 1) * ratio - 1."""
    kv_heads = kv.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    return kv if kv_heads == q_heads else kv.repeat_interleave(q_heads // kv_heads, dim=2)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Scores capped as softcap * tanh(scores / softcap) before the softmax, which SDPA cannot do;
    float32 throughout, as flash-attn accumulates."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
