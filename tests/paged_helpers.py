"""What the paged-cache tests share: a minimal block manager that hands out shuffled page ids, and a
runner that drives a static KIVICache and a PagedKIVICache through the same appends."""

from __future__ import annotations

import random

import torch

from kivi_ops import KIVICache, Step
from kivi_ops.cache.paged import PagedKIVICache


class ShuffledPages:
    """Allocates pages from a shuffled free list (non-contiguous, out of order ids) as rows grow:
    before an append, every row gets pages_needed(length + count) pages."""

    def __init__(self, cache: PagedKIVICache, seed: int = 0):
        self.cache = cache
        self.free = list(range(cache.num_pages))
        random.Random(seed).shuffle(self.free)
        self.owned = [[] for _ in range(cache.batch_size)]
        # Garbage in the unused entries: never read (the kernels clamp ids and mask by length).
        cache.block_table.copy_(torch.randint(-5, cache.num_pages + 5, cache.block_table.shape,
                                              generator=torch.Generator().manual_seed(seed)).to(torch.int32))

    def reserve(self, counts) -> None:
        lengths = self.cache.lengths().tolist()
        for b, c in enumerate(counts):
            need = self.cache.pages_needed(lengths[b] + c)
            while len(self.owned[b]) < need:
                page = self.free.pop()
                self.cache.block_table[b, len(self.owned[b])] = page
                self.owned[b].append(page)

    def release(self, row: int) -> None:
        self.free.extend(self.owned[row])
        self.owned[row] = []


def make_pair(cfg, *, B, H, D, page_size, max_pages, num_pages=None, dtype=torch.float32, device="cpu", seed=0,
              **kwargs):
    """(static KIVICache, PagedKIVICache, ShuffledPages) of the same capacity S = max_pages * page_size."""
    S = max_pages * page_size
    static = KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D, dtype=dtype,
                       device=device, **kwargs)
    paged = PagedKIVICache(cfg, num_layers=1, batch_size=B, num_pages=num_pages or B * max_pages + 3,
                           page_size=page_size, max_pages_per_seq=max_pages, num_kv_heads=H, head_dim=D, dtype=dtype,
                           device=device, **kwargs)
    return static, paged, ShuffledPages(paged, seed)


def append_both(static, paged, manager, key, value, counts=None, prefill=False):
    n = key.shape[2]
    manager.reserve([n] * static.batch_size if counts is None else counts.tolist())
    step = Step(counts=counts, prefill=prefill)
    static.layers[0].append(key, value, step)
    paged.layers[0].append(key, value, step)


def assert_same_state(static, paged):
    ks, vs = static.layers[0].dequantized()
    kp, vp = paged.layers[0].dequantized()
    assert torch.equal(static.lengths(), paged.lengths())
    assert torch.equal(ks, kp) and torch.equal(vs, vp)
