"""The paged fp cache (kivi_ops/cache/paged_fp.py) against the static FPLayer (the same state bit for bit,
attention to rounding), and moving sequences with kivi_ops/cache/paged_io.py (swap to host and back,
staging copies): the same outputs bit for bit."""

from __future__ import annotations

import pytest
import torch

from kivi_ops import FPCache, Step
from kivi_ops.cache.paged_fp import PagedFPCache, pages_needed
from kivi_ops.cache.paged_io import copy_sequence, load_sequence, save_sequence

H, D, PS = 2, 16, 4


def caches(B=3, pages=24, max_pages=8, dtype=torch.float32):
    paged = PagedFPCache(num_layers=2, batch_size=B, num_kv_heads=H, head_dim=D, num_pages=pages, page_size=PS,
                         max_pages_per_seq=max_pages, dtype=dtype)
    static = FPCache(num_layers=2, batch_size=B, max_seq_len=max_pages * PS, num_kv_heads=H, head_dim=D, dtype=dtype)
    return paged, static


def give_pages(cache, gen, tokens_per_row):
    """Scattered, shuffled page ids for each row (as a block manager would hand them out)."""
    ids = torch.randperm(cache.num_pages, generator=gen).tolist()
    for b, n in enumerate(tokens_per_row):
        k = pages_needed(n, PS)
        cache.block_table[b, :k] = torch.tensor(ids[:k], dtype=torch.int32)
        ids = ids[k:]


def run(cache, steps, layer_idx=0):
    """Append then attend, per step: (keys, values, queries, counts); returns the outputs."""
    outs = []
    layer = cache.layers[layer_idx]
    for k, v, q, counts in steps:
        step = Step(counts=counts)
        layer.append(k, v, step)
        outs.append(layer.attend(q, step))
    return outs


def make_steps(gen, B, dtype=torch.float32):
    prompt = torch.tensor([7, 3, 0])  # ragged, one row empty
    steps = [(torch.randn(B, H, 7, D, generator=gen, dtype=dtype), torch.randn(B, H, 7, D, generator=gen, dtype=dtype),
              torch.randn(B, 2 * H, 7, D, generator=gen, dtype=dtype), prompt)]
    for i in range(9):
        counts = torch.tensor([1, 1, 1 if i % 2 else 0])
        steps.append((torch.randn(B, H, 1, D, generator=gen, dtype=dtype),
                      torch.randn(B, H, 1, D, generator=gen, dtype=dtype),
                      torch.randn(B, 2 * H, 1, D, generator=gen, dtype=dtype), counts))
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_and_state_equal_the_static_layer(dtype):
    gen = torch.Generator().manual_seed(0)
    paged, static = caches(dtype=dtype)
    give_pages(paged, gen, [16, 12, 5])
    steps = make_steps(gen, 3, dtype)
    # SDPA on CPU reduces a 32-token row and a 33-token row (FPLayer's spare slot) in different
    # orders, so the outputs agree to rounding, not bit for bit (the stored state does, below).
    for got, want in zip(run(paged, steps), run(static, steps)):
        torch.testing.assert_close(got, want)
    assert torch.equal(paged.lengths(), static.lengths())
    for a, b in zip(paged.layers[0].dequantized(), static.layers[0].dequantized()):
        n = b.shape[2]
        assert torch.equal(a[:, :, :n], b)


def test_swap_out_and_back_into_other_pages_and_row_continues_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    steps = make_steps(gen, 3)
    reference, _ = caches()
    give_pages(reference, torch.Generator().manual_seed(5), [16, 12, 5])
    want = run(reference, steps)

    cache, _ = caches()
    give_pages(cache, torch.Generator().manual_seed(5), [16, 12, 5])
    got = run(cache, steps[:5])
    # Swap row 0 out, scribble over its pages, then bring it back into fresh pages.
    pages = cache.block_table[0, :pages_needed(int(cache.lengths()[0]), PS)].tolist()
    saved = save_sequence(cache, 0, pages)
    for layer in cache.layers:
        layer.k[pages] = 99.0
        layer.v[pages] = -99.0
    used = set(cache.block_table.flatten().tolist())
    fresh = [p for p in range(cache.num_pages) if p not in used][:4]
    load_sequence(cache, 0, fresh[:len(pages)], saved)
    cache.block_table[0, :4] = torch.tensor(fresh, dtype=torch.int32)
    got += run(cache, steps[5:])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_copy_sequence_from_a_staging_cache_equals_appending_in_place():
    gen = torch.Generator().manual_seed(2)
    k, v, q = (torch.randn(1, h, 10, D, generator=gen) for h in (H, H, 2 * H))
    staging = PagedFPCache(num_layers=2, batch_size=1, num_kv_heads=H, head_dim=D, num_pages=8, page_size=PS,
                           max_pages_per_seq=8)
    staging.block_table[0] = torch.arange(8, dtype=torch.int32)
    for layer in staging.layers:
        layer.append(k, v, Step(prefill=True))
    cache, _ = caches()
    cache.block_table[2, :3] = torch.tensor([17, 4, 9], dtype=torch.int32)
    copy_sequence(cache, 2, [17, 4, 9], staging, 0, range(3))
    assert cache.lengths().tolist() == [0, 0, 10]
    query = torch.zeros(3, 2 * H, 1, D)
    query[2] = q[0, :, -1:]
    counts = torch.tensor([0, 0, 1])
    for layer, (sk, sv) in zip(cache.layers, (layer.dequantized() for layer in staging.layers)):
        kk, vv = layer.dequantized()
        assert torch.equal(kk[2], sk[0]) and torch.equal(vv[2], sv[0])
    # and the next token attends over them as over the staging cache's own
    new_k, new_v = torch.randn(3, H, 1, D, generator=gen), torch.randn(3, H, 1, D, generator=gen)
    cache.layers[0].append(new_k, new_v, Step(counts=counts))
    staging.layers[0].append(new_k[2:], new_v[2:])
    # The copy is checked bit for bit above. The attention compares the same numbers through CPU
    # SDPA at batch 3 and batch 1, which may sum in another order (it does on some CPUs): fp32
    # rounding of a 11-token softmax-weighted sum of values |v| < 5 stays far below 1e-5.
    torch.testing.assert_close(cache.layers[0].attend(query, Step(counts=counts))[2],
                               staging.layers[0].attend(query[2:])[0], rtol=0, atol=1e-5)


def test_an_append_into_a_page_the_table_does_not_give_is_refused_by_name():
    cache, _ = caches()
    cache.block_table[0, 0] = 3  # one page: 4 tokens
    layer = cache.layers[0]
    layer.append(torch.randn(3, H, 4, D), torch.randn(3, H, 4, D), Step(counts=torch.tensor([4, 0, 0])))
    with pytest.raises(ValueError, match=r"block_table\[0, 1\].*allocate its pages first"):
        layer.append(torch.randn(3, H, 1, D), torch.randn(3, H, 1, D), Step(counts=torch.tensor([1, 0, 0])))


def test_sizes_and_bad_arguments():
    cache, _ = caches(pages=10, max_pages=8)
    assert pages_needed(0, PS) == 0 and pages_needed(4, PS) == 1 and pages_needed(5, PS) == 2
    assert cache.page_nbytes() == 2 * 2 * H * PS * D * 4  # layers x (k, v) x ... fp32
    assert cache.nbytes() == 10 * cache.page_nbytes() + 3 * 8 * 4  # pages + the int32 block table
    assert cache.layers[0].k.shape[0] == 11  # + the null page
    assert (cache.block_table == 10).all()
    for name in ("num_pages", "page_size", "max_pages_per_seq", "batch_size"):
        kwargs = dict(num_layers=1, batch_size=1, num_kv_heads=H, head_dim=D, num_pages=4, page_size=4,
                      max_pages_per_seq=2)
        kwargs[name] = 0
        with pytest.raises(ValueError, match=name):
            PagedFPCache(**kwargs)
    with pytest.raises(ValueError, match="num_tokens"):
        pages_needed(-1, PS)
    with pytest.raises(TypeError, match="copy_sequence"):
        cache.load_row(0, cache)
