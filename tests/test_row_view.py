"""kivi_ops.cache.row_view.leading_rows: a step over a paged cache's first rows writes into the cache
itself what a step over the whole cache with the other rows idle (counts 0) writes, bit for bit,
and attends as it does for those rows (up to the summation order of batched products)."""

import copy

import pytest
import torch

from kivi_ops import KIVIConfig, Step
from kivi_ops.cache.paged import PagedKIVICache
from kivi_ops.cache.paged_fp import PagedFPCache
from kivi_ops.cache.row_view import leading_rows
from paged_helpers import ShuffledPages

B, H, HQ, D = 5, 2, 4, 32


def _paged_kivi():
    cache = PagedKIVICache(KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16), num_layers=2,
                           batch_size=B, num_pages=B * 6, page_size=16, max_pages_per_seq=6, num_kv_heads=H,
                           head_dim=D)
    return cache, ShuffledPages(cache)


def _paged_fp():
    cache = PagedFPCache(num_layers=2, batch_size=B, num_kv_heads=H, head_dim=D, num_pages=B * 6, page_size=8,
                         max_pages_per_seq=10)
    manager = ShuffledPages(cache)
    cache.block_table.fill_(cache.num_pages)  # the null page: this layer reads every table entry
    return cache, manager


@pytest.mark.parametrize("make", [_paged_kivi, _paged_fp], ids=["kivi", "fp"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_view_writes_the_cache_and_attends_as_the_whole_cache(make, rows):
    whole, manager = make()
    g = torch.Generator().manual_seed(0)
    prompt = torch.tensor([37, 5, 20, 0, 0])  # rows 3 and 4: no request
    manager.reserve(prompt.tolist())
    kv = [torch.randn(B, H, 37, D, generator=g) for _ in range(2)]
    for layer in whole.layers:
        layer.append(*kv, Step(counts=prompt, prefill=True))
    mine = copy.deepcopy(whole)
    view = leading_rows(mine, rows)
    assert view.batch_size == rows and view.lengths().shape == (rows,)
    assert view.layers[0].lengths.data_ptr() == mine.layers[0].lengths.data_ptr()  # a view, not a copy
    width = mine.block_table.shape[1]
    assert view.block_table.shape == (rows, width) and all(layer.block_table.shape == (rows, width)
                                                           for layer in view.layers)
    assert dict(view.named_buffers()).keys() == dict(mine.named_buffers()).keys()
    for i in range(40):  # several key flushes (R=16) at different steps per row
        counts = torch.tensor([1, 1 if i % 3 else 0, 1, 0, 0][:rows] + [0] * (B - rows))  # idle past the view
        manager.reserve(counts.tolist())
        mine.block_table.copy_(whole.block_table)  # the same pages for both
        kv = [torch.randn(B, H, 1, D, generator=g) for _ in range(2)]
        query = torch.randn(B, HQ, 1, D, generator=g)
        for layer, layer_view in zip(whole.layers, view.layers):
            layer.append(*kv, Step(counts=counts))
            layer_view.append(kv[0][:rows], kv[1][:rows], Step(counts=counts[:rows]))
            want = layer.attend(query, Step(counts=counts))
            got = layer_view.attend(query[:rows], Step(counts=counts[:rows]))
            # The same products per row; CPU batched matmuls may sum in another order for another
            # batch size: a few float32 ulps of outputs of magnitude < 1 (D = 32 terms).
            torch.testing.assert_close(got, want[:rows], rtol=0, atol=D * 2**-24, msg=f"step {i}")
        for want_layer, got_layer in zip(whole.layers, mine.layers):  # every row and page of the cache itself
            for name, t in want_layer.row_tensors().items():  # the idle rows as they were
                assert torch.equal(got_layer.row_tensors()[name], t), (i, name)
            for name, t in want_layer.page_tensors().items():  # not the scratch page, where idle rows write
                assert torch.equal(got_layer.page_tensors()[name][:whole.num_pages], t[:whole.num_pages]), (i, name)


def test_all_rows_is_the_cache_and_bad_counts_are_refused():
    cache, _ = _paged_kivi()
    assert leading_rows(cache, B) is cache
    for bad in (0, B + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"rows must be an int in \[1, 5\]"):
            leading_rows(cache, bad)
