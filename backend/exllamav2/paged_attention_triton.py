"""Paged attention that reads each page once: a Triton kernel behind flash-attn's `flash_attn_with_kvcache`.

backend.exllamav2.paged_attention (setting `sdpa`) gathers every sequence's pages into new tensors
and repeats each K/V head for its group of query heads before torch's SDPA: at an 8B model's shape
and 64 streams that moves many times the bytes the live K/V hold (../shared/research/gpu-real-size.md).
Here one kernel program takes one sequence, one K/V head and a tile of its queries *with every query
head of that group*, walks the block table itself (page block_table[b, key // page_size], slot
key % page_size) and keeps a running softmax: each page of K and V is read once per K/V head, no
copy is made, nothing is repeated per query head, and the sequence lengths stay on the device (no
sync to trim the read: the kernel stops at each sequence's own length).

The same semantics as flash-attn 2.8.3 and as the SDPA provider, which this module shares its
argument handling, in-place append and `stats` with: causal aligned bottom-right, sliding windows,
tanh softcapping, grouped-query attention (query head h reads K/V head h // (Hq / Hkv)), rows with
no key return zeros. Scores and the softmax are float32 whatever the cache's dtype.

Triton compiles the kernel for the GPU at its first call per shape; with TRITON_INTERPRET=1 set
before this module is imported it runs on CPU tensors instead (the tests' way: it proves the
numerics, not the speed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.exllamav2 import paged_attention as pa

NO_WINDOW = pa.NO_WINDOW
MIN_DOT = 16  # tl.dot's smallest tile side on NVIDIA GPUs
DECODE_ROWS = 16  # query rows per program when a step has few (decode: one token times the group)
PREFILL_ROWS = 64
KEYS_PER_TILE = 64


def flash_attn_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
    v: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0, return_softmax_lse: bool = False,
) -> torch.Tensor:
    """As backend.exllamav2.paged_attention.flash_attn_with_kvcache (same arguments, same result),
    read through the block table by one kernel instead of gathered copies. Returns (B, Lq, Hq, D), contiguous."""
    call = pa.kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                           cache_batch_idx, cache_leftpad, alibi_slopes, return_softmax_lse)
    pa.check_capacity(call.cache_seqlens, 0 if k is None else k.shape[1], k_cache, call.block_table)
    return paged_attention(q, k_cache, v_cache, call.key_lengths, call.block_table, softmax_scale, causal,
                           window_size, softcap)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_lengths: torch.Tensor,
    block_table: torch.Tensor | None, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
) -> torch.Tensor:
    """q (B, Lq, Hq, D) over caches (pages, page_size, Hkv, D) addressed by block_table (B, width),
    or (B, max_len, Hkv, D) without one; sequence b attends over key_lengths[b] keys (a device tensor)."""
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous in their last (head) dimension")
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0 or q_len == 0:
        return out
    rows = DECODE_ROWS if q_len * group <= DECODE_ROWS else PREFILL_ROWS
    left, right = window_size
    if causal:
        right = 0
    paged = block_table is not None
    table = block_table if block_table is not None else key_lengths  # an unused stand-in without a table
    grid = (batch, kv_heads, triton.cdiv(q_len * group, rows))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, table, key_lengths.to(torch.int32),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3],
        table.stride(0) if paged else 0, table.shape[-1] if paged else 0,
        q_len, head_dim, softmax_scale if softmax_scale is not None else head_dim**-0.5, float(softcap), left, right,
        GROUP=group, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged, SOFTCAP=bool(softcap),
        BLOCK_M=rows, BLOCK_N=KEYS_PER_TILE, PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    return out


@triton.jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # Triton types the arguments
    Q, K, V, Out, Table, KeyLengths,
    stride_qb, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_table, table_width,
    q_len, head_dim, scale, softcap, window_left, window_right,
    GROUP: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # One program: sequence b, K/V head `kv_head`, query rows row = token * GROUP + g of that head group.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    row_ok = token < q_len
    dim_ok = dims < head_dim
    q = tl.load(Q + b * stride_qb + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    key_len = tl.load(KeyLengths + b)
    position = key_len - q_len + token  # each query's own key position (bottom-right)

    # The keys any row of this tile may read: up to the last row's position (+ window), from the first's.
    first = key_len - q_len + (tl.program_id(2) * BLOCK_M) // GROUP
    last = key_len - q_len + tl.minimum((tl.program_id(2) * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    hi = key_len
    if window_right >= 0:
        hi = tl.minimum(hi, last + window_right + 1)
    lo = key_len * 0
    if window_left >= 0:
        lo = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        if PAGED:
            page_ok = (keys < hi) & (keys // PAGE_SIZE < table_width)
            page = tl.load(Table + b * stride_table + keys // PAGE_SIZE, mask=page_ok, other=0).to(tl.int64)
            slot = keys % PAGE_SIZE
        else:
            page_ok = keys < hi
            page = tl.zeros([BLOCK_N], tl.int64) + b
            slot = keys
        kv_mask = page_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))  # softcap * tanh(scores / softcap)
        allowed = row_ok[:, None] & page_ok[None, :] & (keys[None, :] < key_len)
        if window_right >= 0:
            allowed = allowed & (keys[None, :] <= position[:, None] + window_right)
        if window_left >= 0:
            allowed = allowed & (keys[None, :] >= position[:, None] - window_left)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)  # no key at all: zeros
    tl.store(Out + b * stride_ob + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
