"""backend.exllamav2.paged_attention (SDPA over gathered pages) and paged_attention_triton (a kernel
that reads the pages through the block table) against a plain reference: per sequence, per head, a
float64 softmax over an explicit dense cache. float32 on the CPU, the kernel in Triton's interpreter;
the GPU check covers fp16 kernels compiled and exllamav2."""

from __future__ import annotations

import inspect
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from backend.exllamav2 import paged_attention as pa

try:  # in Triton's interpreter on CPU tensors: tests/conftest.py sets TRITON_INTERPRET where there is no GPU
    from backend.exllamav2 import paged_attention_triton as pt
except ImportError:  # triton is in the dev extra; without it only the SDPA provider is tested
    pt = None

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
HEAD_DIM = 8


@pytest.fixture(params=["sdpa", "triton"])
def kvcache(request):
    """Each provider's flash_attn_with_kvcache: the same calls, the same expected results."""
    if request.param == "triton":
        if pt is None:
            pytest.skip("triton is not installed")
        return pt.flash_attn_with_kvcache
    return pa.flash_attn_with_kvcache


def reference(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0):
    """One sequence: q (Lq, Hq, D) over k, v (Lk, Hkv, D), written out from flash-attn's definition."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, q_heads, dim = q.shape
    k_len, kv_heads = k.shape[:2]
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for head in range(q_heads):
        kv_head = head // (q_heads // kv_heads)
        scores = q[:, head] @ k[:, kv_head].T * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        for i in range(q_len):
            position = k_len - q_len + i  # the query's own key position (bottom-right)
            keys = [j for j in range(k_len) if allowed(j, position, causal, window)]
            if keys:
                weights = torch.softmax(scores[i, keys], dim=0)
                out[i, head] = weights @ v[keys, kv_head]
    return out


def allowed(key, position, causal, window):
    left, right = window
    if causal and key > position:
        return False
    if left >= 0 and key < position - left:
        return False
    return not (right >= 0 and key > position + right)


class PagedCache:
    """A paged cache and its dense truth: sequence b's keys live in pages listed by a shuffled block
    table padded with page 0, as exllamav2's generator lays it out."""

    def __init__(self, seed, lengths, capacity, kv_heads, page_size):
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages_per_sequence = -(-capacity // page_size)
        width = pages_per_sequence + 2  # padding columns, as a job's budget leaves them
        num_pages = 1 + len(lengths) * pages_per_sequence + 3  # page 0 and a few nobody owns
        owned = (torch.randperm(num_pages - 1, generator=self.gen) + 1)[: len(lengths) * pages_per_sequence]
        self.block_table = torch.zeros((len(lengths), width), dtype=torch.int32)
        self.block_table[:, :pages_per_sequence] = owned.view(len(lengths), pages_per_sequence).int()
        shape = (num_pages, page_size, kv_heads, HEAD_DIM)
        self.k_cache, self.v_cache = self.randn(*shape), self.randn(*shape)
        self.lengths = list(lengths)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def dense(self, cache, b, length):
        rows = [cache[self.block_table[b, p // self.page_size], p % self.page_size] for p in range(length)]
        return torch.stack(rows) if rows else cache[0, :0]

    def seqlens(self):
        return torch.tensor(self.lengths, dtype=torch.int32)


def expected_for(cache, q, total_lengths, **options):
    return [
        reference(q[b], cache.dense(cache.k_cache, b, n), cache.dense(cache.v_cache, b, n), **options)
        for b, n in enumerate(total_lengths)
    ]


def assert_batch_matches(out, expected):
    assert out.is_contiguous()
    for b, want in enumerate(expected):
        torch.testing.assert_close(out[b].double(), want, **TOLERANCE)


@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
@pytest.mark.parametrize("page_size,lengths,new", [(4, [0, 5, 13], 1), (4, [3, 9, 1], 6), (256, [250, 0, 511], 9)])
def test_appended_tokens_land_in_their_pages_and_attend_bottom_right(kvcache, ratio, page_size, lengths, new):
    kv_heads = 2 if ratio < 8 else 1
    cache = PagedCache(seed=ratio * 7 + new, lengths=lengths, capacity=max(lengths) + new, kv_heads=kv_heads,
                       page_size=page_size)
    batch = len(lengths)
    q = cache.randn(batch, new, kv_heads * ratio, HEAD_DIM)
    k, v = cache.randn(batch, new, kv_heads, HEAD_DIM), cache.randn(batch, new, kv_heads, HEAD_DIM)
    old_k = [cache.dense(cache.k_cache, b, n) for b, n in enumerate(lengths)]
    k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()

    out = kvcache(q, cache.k_cache, cache.v_cache, k=k, v=v, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True)

    totals = [n + new for n in lengths]
    for b, n in enumerate(lengths):
        torch.testing.assert_close(cache.dense(cache.k_cache, b, totals[b]), torch.cat([old_k[b], k[b]]))
        torch.testing.assert_close(cache.dense(cache.v_cache, b, totals[b])[n:], v[b])
    written = (cache.k_cache != k_before).any(-1).any(-1).sum() + (cache.v_cache != v_before).any(-1).any(-1).sum()
    assert written == 2 * batch * new  # nothing outside the appended slots changed
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_batch_matches(out, expected_for(cache, q, totals, causal=True))


@pytest.mark.parametrize("new", [1, 7])
def test_post_append_mode_gives_the_same_output_and_cache_as_append_mode(kvcache, new):
    appending = PagedCache(seed=new, lengths=[6, 2], capacity=16, kv_heads=2, page_size=4)
    sequential = PagedCache(seed=new, lengths=[6, 2], capacity=16, kv_heads=2, page_size=4)
    q = appending.randn(2, new, 4, HEAD_DIM)
    k, v = appending.randn(2, new, 2, HEAD_DIM), appending.randn(2, new, 2, HEAD_DIM)
    appended = kvcache(q, appending.k_cache, appending.v_cache, k=k, v=v,
                                          cache_seqlens=appending.seqlens(), block_table=appending.block_table,
                                          causal=True)
    # exllamav2's is_sequential path: it copies K/V into the cache itself, then passes post-append lengths.
    for b, n in enumerate(sequential.lengths):
        for t in range(new):
            page, slot = sequential.block_table[b, (n + t) // 4], (n + t) % 4
            sequential.k_cache[page, slot], sequential.v_cache[page, slot] = k[b, t], v[b, t]
    after = kvcache(q, sequential.k_cache, sequential.v_cache,
                                       cache_seqlens=sequential.seqlens() + new, block_table=sequential.block_table,
                                       causal=True)
    torch.testing.assert_close(after, appended, rtol=0, atol=0)
    torch.testing.assert_close(sequential.k_cache, appending.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(sequential.v_cache, appending.v_cache, rtol=0, atol=0)


def test_lengths_on_the_device_read_the_whole_block_table_with_the_same_result(kvcache, monkeypatch):
    # On a GPU exllamav2's cache_seqlens are device tensors: the provider does not sync to trim the read.
    cache = PagedCache(seed=21, lengths=[3, 10, 6], capacity=16, kv_heads=2, page_size=4)
    q = cache.randn(3, 2, 4, HEAD_DIM)
    k, v = cache.randn(3, 2, 2, HEAD_DIM), cache.randn(3, 2, 2, HEAD_DIM)
    monkeypatch.setattr(pa, "_host_longest", lambda cache_seqlens: None)
    out = kvcache(q, cache.k_cache, cache.v_cache, k=k, v=v, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True)
    assert_batch_matches(out, expected_for(cache, q, [5, 12, 8], causal=True))


def test_a_sequence_longer_than_its_block_table_is_refused(kvcache):
    cache = PagedCache(seed=2, lengths=[4], capacity=8, kv_heads=1, page_size=4)  # 2 pages + 2 padding columns
    q = cache.randn(1, 1, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="does not fit"):
        kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=17,
                                   block_table=cache.block_table, causal=True)


def test_an_integer_cache_seqlens_applies_to_every_sequence(kvcache):
    cache = PagedCache(seed=3, lengths=[5, 5], capacity=8, kv_heads=1, page_size=4)
    q = cache.randn(2, 1, 2, HEAD_DIM)
    as_int = kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=5,
                                        block_table=cache.block_table, causal=True)
    as_tensor = kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                           block_table=cache.block_table, causal=True)
    torch.testing.assert_close(as_int, as_tensor, rtol=0, atol=0)


@pytest.mark.parametrize("window", [(3, 3), (0, 0), (20, 20)])
def test_a_sliding_window_keeps_only_the_last_keys_before_each_query(kvcache, window):
    cache = PagedCache(seed=11, lengths=[9, 4], capacity=14, kv_heads=2, page_size=4)
    q = cache.randn(2, 3, 4, HEAD_DIM)
    k, v = cache.randn(2, 3, 2, HEAD_DIM), cache.randn(2, 3, 2, HEAD_DIM)
    out = kvcache(q, cache.k_cache, cache.v_cache, k=k, v=v, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True, window_size=window)
    assert_batch_matches(out, expected_for(cache, q, [12, 7], causal=True, window=window))


def test_without_causal_each_query_reads_exactly_its_sequences_live_keys(kvcache):
    # Slots past a sequence's length hold other data (the rest of its page, padding page 0): never read.
    cache = PagedCache(seed=13, lengths=[1, 6, 11], capacity=12, kv_heads=2, page_size=4)
    q = cache.randn(3, 2, 4, HEAD_DIM)
    out = kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table)
    assert_batch_matches(out, expected_for(cache, q, [1, 6, 11]))


def test_softcap_caps_the_scores_with_tanh_before_the_softmax(kvcache):
    cache = PagedCache(seed=5, lengths=[7, 3, 10], capacity=12, kv_heads=2, page_size=4)
    q = cache.randn(3, 2, 8, HEAD_DIM) * 4  # large scores, so the cap changes the result
    out = kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True, softmax_scale=0.5, softcap=2.0)
    assert_batch_matches(out, expected_for(cache, q, [7, 3, 10], causal=True, scale=0.5, softcap=2.0))
    uncapped = kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                          block_table=cache.block_table, causal=True, softmax_scale=0.5)
    assert not torch.allclose(out, uncapped)


def test_a_contiguous_cache_without_block_table_appends_and_attends_per_row(kvcache):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(3, 12, 2, HEAD_DIM, generator=gen), torch.randn(3, 12, 2, HEAD_DIM, generator=gen)
    lengths, new = [4, 0, 9], 3
    q = torch.randn(3, new, 4, HEAD_DIM, generator=gen)
    k, v = torch.randn(3, new, 2, HEAD_DIM, generator=gen), torch.randn(3, new, 2, HEAD_DIM, generator=gen)
    out = kvcache(q, k_cache, v_cache, k=k, v=v,
                                     cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=True)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(k_cache[b, n : n + new], k[b])
        torch.testing.assert_close(v_cache[b, n : n + new], v[b])
        want = reference(q[b], k_cache[b, : n + new], v_cache[b, : n + new], causal=True)
        torch.testing.assert_close(out[b].double(), want, **TOLERANCE)
    assert out.is_contiguous()


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("q_len,k_len", [(3, 10), (5, 5), (6, 4)])
def test_flash_attn_func_aligns_causal_queries_with_the_last_keys(ratio, q_len, k_len):
    gen = torch.Generator().manual_seed(q_len * 31 + k_len)
    q = torch.randn(2, q_len, 2 * ratio, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, k_len, 2, HEAD_DIM, generator=gen), torch.randn(2, k_len, 2, HEAD_DIM, generator=gen)
    out = pa.flash_attn_func(q, k, v, causal=True)
    assert_batch_matches(out, [reference(q[b], k[b], v[b], causal=True) for b in range(2)])
    if q_len > k_len:  # queries before the first key read nothing: zeros, as flash-attn gives
        assert not out[:, : q_len - k_len].any()


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (False, (2, 1), 0.0), (True, (3, 3), 1.5)])
def test_flash_attn_func_applies_window_and_softcap_like_flash_attn(causal, window, softcap):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 6, 4, HEAD_DIM, generator=gen) * 3
    k, v = torch.randn(1, 8, 2, HEAD_DIM, generator=gen), torch.randn(1, 8, 2, HEAD_DIM, generator=gen)
    out = pa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, softmax_scale=0.3)
    want = reference(q[0], k[0], v[0], scale=0.3, causal=causal, window=window, softcap=softcap)
    assert_batch_matches(out, [want])


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_flash_attn_func_on_each_segment(causal):
    gen = torch.Generator().manual_seed(4)
    q_lens, k_lens = [3, 1, 5], [3, 6, 5]
    q = torch.randn(sum(q_lens), 4, HEAD_DIM, generator=gen)
    k, v = torch.randn(sum(k_lens), 2, HEAD_DIM, generator=gen), torch.randn(sum(k_lens), 2, HEAD_DIM, generator=gen)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 9, 14], dtype=torch.int32)
    out = pa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    assert out.shape == q.shape and out.is_contiguous()
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = pa.flash_attn_func(q[None, qs], k[None, ks], v[None, ks], causal=causal)
        torch.testing.assert_close(out[qs], alone[0], **TOLERANCE)


def test_stats_count_a_paged_call_that_batches_several_sequences(kvcache):
    pa.stats.reset()
    cache = PagedCache(seed=8, lengths=[2, 6, 3], capacity=8, kv_heads=1, page_size=4)
    q = cache.randn(3, 2, 2, HEAD_DIM)
    k, v = cache.randn(3, 2, 1, HEAD_DIM), cache.randn(3, 2, 1, HEAD_DIM)
    kvcache(q, cache.k_cache, cache.v_cache, k=k, v=v, cache_seqlens=cache.seqlens(),
                               block_table=cache.block_table, causal=True)
    pa.flash_attn_func(q, k, v, causal=True)
    assert pa.stats.snapshot() == dict(calls=2, kvcache_calls=1, paged_calls=1, largest_kvcache_batch=3,
                                       appended_tokens=6)


def test_half_precision_stays_half(kvcache):
    cache = PagedCache(seed=1, lengths=[5, 2], capacity=8, kv_heads=1, page_size=4)
    cache.k_cache, cache.v_cache = cache.k_cache.half(), cache.v_cache.half()
    q = cache.randn(2, 1, 2, HEAD_DIM).half()
    out = kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True)
    assert out.dtype == torch.float16
    for b, want in enumerate(expected_for(cache, q, [5, 2], causal=True)):
        torch.testing.assert_close(out[b].double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("argument", [dict(rotary_cos=torch.ones(1)), dict(cache_batch_idx=torch.zeros(1)),
                                      dict(cache_leftpad=torch.zeros(1)), dict(alibi_slopes=torch.ones(1)),
                                      dict(return_softmax_lse=True)])
def test_arguments_exllamav2_never_passes_are_refused_by_name(kvcache, argument):
    q = torch.zeros(1, 1, 1, HEAD_DIM)
    with pytest.raises(NotImplementedError, match=next(iter(argument)).split("_cos")[0]):
        kvcache(q, q, q, cache_seqlens=1, **argument)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        pa.flash_attn_func(q, q, q, dropout_p=0.1)


def test_signatures_show_exllamav2_window_and_softcap():
    for function in (pa.flash_attn_func, pa.flash_attn_varlen_func, pa.flash_attn_with_kvcache):
        assert {"window_size", "softcap", "softmax_scale", "causal"} <= set(inspect.signature(function).parameters)


@pytest.mark.skipif(pt is None, reason="triton is not installed")
@pytest.mark.parametrize("device_lengths", [False, True])
def test_the_kernel_reads_no_slot_past_a_sequences_length(monkeypatch, device_lengths):
    # Every slot no sequence owns up to its length (the rest of its last page, the padding page 0,
    # pages nobody owns) holds NaN: one read of it would poison the output; the gathering provider
    # reads them all and only masks their scores, which NaN in V defeats.
    cache = PagedCache(seed=17, lengths=[3, 9, 14], capacity=16, kv_heads=2, page_size=4)
    truth_k, truth_v = cache.k_cache.clone(), cache.v_cache.clone()
    live = torch.zeros(cache.k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(cache.lengths):
        for p in range(n):
            live[cache.block_table[b, p // 4], p % 4] = True
    cache.k_cache[~live], cache.v_cache[~live] = float("nan"), float("nan")
    if device_lengths:
        monkeypatch.setattr(pa, "_host_longest", lambda cache_seqlens: None)
    q = cache.randn(3, 2, 8, HEAD_DIM)
    out = pt.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True)
    assert torch.isfinite(out).all()
    cache.k_cache, cache.v_cache = truth_k, truth_v
    assert_batch_matches(out, expected_for(cache, q, cache.lengths, causal=True))
    gathered = pa.flash_attn_with_kvcache(q, cache.k_cache.masked_fill(~live[..., None, None], float("nan")),
                                          cache.v_cache.masked_fill(~live[..., None, None], float("nan")),
                                          cache_seqlens=cache.seqlens(), block_table=cache.block_table, causal=True)
    assert not torch.isfinite(gathered).all()  # what the test would catch: the old path reads past the lengths


@pytest.mark.skipif(pt is None, reason="triton is not installed")
def test_the_kernel_takes_flash_attn_with_kvcache_exactly_as_the_sdpa_provider_does():
    assert inspect.signature(pt.flash_attn_with_kvcache) == inspect.signature(pa.flash_attn_with_kvcache)


@pytest.mark.skipif(pt is None, reason="triton is not installed")
def test_the_kernel_at_a_llama_head_size_in_half_precision():
    # Head dim 128 and 32/8 heads as Llama-3-8B, fp16 cache, a 256-token page, several key tiles.
    cache = PagedCache(seed=23, lengths=[300, 70], capacity=320, kv_heads=8, page_size=256)  # its table; caches below
    gen = torch.Generator().manual_seed(5)
    num_pages = cache.k_cache.shape[0]
    cache.k_cache = torch.randn(num_pages, 256, 8, 128, generator=gen).half()
    cache.v_cache = torch.randn(num_pages, 256, 8, 128, generator=gen).half()
    q = (torch.randn(2, 1, 32, 128, generator=gen) * 0.5).half()
    out = pt.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.seqlens(),
                                     block_table=cache.block_table, causal=True, softmax_scale=128**-0.5)
    assert out.dtype == torch.float16 and out.is_contiguous()
    for b, want in enumerate(expected_for(cache, q, cache.lengths, causal=True, scale=128**-0.5)):
        torch.testing.assert_close(out[b].double(), want, rtol=2e-3, atol=2e-3)


COMPILE_FOR_HOPPER = """
import sys
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from backend.exllamav2 import paged_attention_triton as pt

kernel = pt._paged_attention_kernel
pointers = dict(Q="*fp16", K="*fp16", V="*fp16", Out="*fp16", Table="*i64", KeyLengths="*i32", scale="fp32", softcap="fp32")
for rows, paged, softcap in ((pt.DECODE_ROWS, True, False), (pt.PREFILL_ROWS, True, True), (pt.DECODE_ROWS, False, False)):
    constants = dict(GROUP=4, BLOCK_D=128, PAGE_SIZE=256 if paged else 1, PAGED=paged, SOFTCAP=softcap, BLOCK_M=rows,
                     BLOCK_N=pt.KEYS_PER_TILE, PRECISION=None)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    ptx = triton_compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".target sm_90" in ptx, ptx[:200]
    print("compiled", rows, paged, softcap)
"""


@pytest.mark.skipif(pt is None, reason="triton is not installed")
def test_the_kernel_compiles_for_an_h100_in_half_precision(tmp_path):
    # Ahead of time, with no GPU: Triton's own compiler down to sm_90 code, as the first call there would
    # (the interpreter above checks the numerics, not what the compiler accepts: tile sides, types). In a
    # process of its own: the interpreter this one runs the kernel in replaces parts of triton.language.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], capture_output=True, text=True, env=env,
                          cwd=pathlib.Path(__file__).resolve().parents[3], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 3
