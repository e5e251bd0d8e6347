"""Prefix caching, below the server: a sequence that starts from a cached prefix (its final pages
shared, its tail restored, serve/prefix_cache.py) holds the same cache and gets the same logits,
bit for bit, as the same prompt prefilled in the same chunks without sharing (prefill_chunked).
Prompts of different lengths share prefixes that end before, at and after R and page boundaries."""

from __future__ import annotations

import pytest
import torch

from kivi_models import make_cache, patch_model
from kivi_models.generate import decode_step, make_paged_cache, prefill_chunked
from kivi_serve.prefix_cache import restore_prefix, save_tail
from kivi_ops import KIVIConfig

CONFIG = KIVIConfig(group_size=4, residual_length=8)
MAX_SEQ_LEN = 64
CHUNK = 4


@pytest.fixture(scope="module")
def model():
    from tiny_models import tiny_llama

    return patch_model(tiny_llama(vocab_size=64, max_position_embeddings=128))


def staging(model, method, page_size):
    """A batch-1 paged cache whose row holds pages 0, 1, ... (the engine's staging cache)."""
    cache = make_paged_cache(model, method=method, batch_size=1, max_seq_len=MAX_SEQ_LEN, num_pages=MAX_SEQ_LEN,
                             page_size=page_size, kivi_config=CONFIG)
    cache.block_table.copy_(torch.arange(cache.max_pages_per_seq, dtype=torch.int32)[None])
    return cache


def sequence_bytes(cache, pages):
    """Every byte of a sequence: its pages (ids `pages`, in table order) and its row, per layer."""
    idx = torch.tensor(list(pages), dtype=torch.long)
    out = {}
    for i, layer in enumerate(cache.layers):
        out.update({(i, k): t.index_select(0, idx) for k, t in layer.page_tensors().items()})
        out.update({(i, k): t.clone() for k, t in layer.row_tensors().items()})
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("method,page_size", [("kivi", 4), ("kivi", 8), ("fp", 4)])
def test_a_prompt_that_starts_from_a_cached_prefix_equals_its_chunked_prefill_bit_for_bit(model, method, page_size):
    torch.manual_seed(1)
    common = torch.randint(0, 64, (40,)).tolist()
    first = common + torch.randint(0, 64, (9,)).tolist()
    owner = staging(model, method, page_size)
    tails = {}
    pages = list(range(owner.max_pages_per_seq))
    prefill_chunked(model, owner, first, CHUNK,
                    on_boundary=lambda b: tails.__setitem__(b, save_tail(owner, 0, pages, b)))
    assert sorted(tails) == list(range(CHUNK, len(first) + 1, CHUNK))
    checked = set()
    # prefixes of 4..40 tokens (below R = 8, at R, past it, on and off page boundaries), then
    # suffixes of 1 to 11 tokens: every prompt ragged against the chunks
    for b in range(CHUNK, len(common) + 1, CHUNK):
        prompt = common[:b] + torch.randint(0, 64, (1 + b % 11,)).tolist()
        want_cache = staging(model, method, page_size)
        want = prefill_chunked(model, want_cache, prompt, CHUNK)
        got_cache = staging(model, method, page_size)
        shared = list(range(owner.pages_final(b)))  # the owner's final pages (ids = logical pages here)
        fresh = list(range(got_cache.max_pages_per_seq))[::-1]  # other ids than the owner's
        got_cache.block_table.copy_(torch.tensor([fresh], dtype=torch.int32))
        restore_prefix(got_cache, 0, fresh, owner, shared, tails[b])
        got = prefill_chunked(model, got_cache, prompt, CHUNK, start=b)
        assert torch.equal(got, want), b
        n = got_cache.pages_needed(len(prompt))
        assert_same(sequence_bytes(got_cache, fresh[:n]), sequence_bytes(want_cache, range(n)))
        checked.add((len(shared) > 0, b % page_size == 0))
    # KIVI: prefixes all tail (no final page before b = R + page) and with shared pages; fp shares
    # every full page; with 8-token pages some prefixes end mid-page
    assert {has_shared for has_shared, _ in checked} == ({True, False} if method == "kivi" else {True})
    assert (page_size == 8) == ((True, False) in checked)


def test_chunked_prefill_in_a_static_kivi_cache_equals_the_paged_one(model):
    # The paged KIVI layer runs the static layer's code through the block table: the same bits for
    # the same capacity. (fp differs: the paged fp cache's SDPA over gathered pages rounds otherwise
    # than the static FPCache's attention, so the server tests' reference is a paged cache.)
    torch.manual_seed(2)
    prompt = torch.randint(0, 64, (29,)).tolist()
    paged = staging(model, "kivi", 4)
    static = make_cache(model, method="kivi", batch_size=1, max_seq_len=MAX_SEQ_LEN, kivi_config=CONFIG)
    assert torch.equal(prefill_chunked(model, paged, prompt, CHUNK), prefill_chunked(model, static, prompt, CHUNK))


def test_prefill_chunked_refuses_bad_arguments_naming_them(model):
    cache = staging(model, "kivi", 4)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        prefill_chunked(model, cache, [1, 2, 3], 0)
    with pytest.raises(ValueError, match="start must be a multiple of chunk=4"):
        prefill_chunked(model, cache, [1, 2, 3, 4, 5], 4, start=2)
    with pytest.raises(ValueError, match="the cache holds 0 tokens"):
        prefill_chunked(model, cache, [1, 2, 3, 4, 5], 4, start=4)


@pytest.mark.parametrize("method", ["kivi", "fp"])
def test_pages_final_at_a_boundary_are_never_written_again(model, method):
    # What makes sharing safe: after b tokens, pages [0, pages_final(b)) keep every byte through
    # later chunks and decode steps (KIVI: keys flushed R at a time, values leaving the window).
    from kivi_ops.paged_layout import pages_final
    from kivi_ops.options.schedule import KIVI, quantized_count_int

    torch.manual_seed(3)
    prompt = torch.randint(0, 64, (30,)).tolist()
    cache = staging(model, method, 4)
    pages = list(range(cache.max_pages_per_seq))
    snapshots = {}
    prefill_chunked(model, cache, prompt, CHUNK,
                    on_boundary=lambda b: snapshots.__setitem__(b, sequence_bytes(cache, pages[:cache.pages_final(b)])))
    with torch.inference_mode():
        for t in range(20):  # decode steps past several key flushes and pages
            L = len(prompt) + t
            decode_step(model, cache, torch.tensor([t % 64]), torch.tensor([L]))
    for b, before in snapshots.items():
        after = sequence_bytes(cache, pages[:cache.pages_final(b)])
        for k in before:
            if k[1] in ("k_res", "v_res", "lengths"):
                continue  # the row state is the tail's: it changes
            assert torch.equal(before[k], after[k]), (b, k)
    if method == "kivi":  # the definition: pages whose tokens all have their keys and values quantized
        for L in range(0, 60):
            nqk, nqv = quantized_count_int(L, CONFIG.residual_length, CONFIG.group_size, KIVI)
            assert pages_final(L, 4, CONFIG.residual_length) == min(nqk, nqv) // 4
    assert sum(cache.pages_final(b) > 0 for b in snapshots) >= 3


@pytest.mark.parametrize("method", ["kivi", "fp"])
def test_the_default_prefix_count_is_what_the_host_budget_holds_at_the_largest_tail(model, method, monkeypatch):
    # --prefix-cache-size's default (kivi_serve.paged_options.default_max_prefixes): each cached prefix keeps a
    # host copy of its tail, whose bytes paged_io.sequence_bytes computes without copying; checked
    # against real tails at every chunk boundary (KIVI's vary with the window's fill).
    from kivi_serve import paged_options
    from kivi_ops.cache.paged_io import sequence_bytes as host_bytes

    cache = staging(model, method, 4)
    pages = list(range(cache.max_pages_per_seq))
    tails = [save_tail(cache, 0, pages, b) for b in range(CHUNK, MAX_SEQ_LEN + 1, CHUNK)]
    sizes = [sum(t.nbytes for t in tail.saved.values()) for tail in tails]
    assert [host_bytes(cache, tail.num_pages) for tail in tails] == sizes
    largest = max(sizes)
    for budget, kept in ((3 * largest + 1, 3), (largest - 1, 1), (10**6 * largest, paged_options.DEFAULT_MAX_PREFIXES)):
        monkeypatch.setattr(paged_options, "PREFIX_HOST_BYTES", budget)
        assert paged_options.default_max_prefixes(cache, CHUNK, MAX_SEQ_LEN) == kept, budget
    # A chunk longer than any sequence (--prefix-chunk 64 with --max-seq-len 48): no boundary, no error.
    assert paged_options.default_max_prefixes(cache, 2 * MAX_SEQ_LEN, MAX_SEQ_LEN) == paged_options.DEFAULT_MAX_PREFIXES
