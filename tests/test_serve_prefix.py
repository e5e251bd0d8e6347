"""`kivi serve --paged --prefix-caching`: requests that start with the same tokens share the pages of
that prefix (block_manager.py, prefix_cache.py). Sharing changes no output: every greedy completion
equals the same prompt prefilled in the same chunks alone, without sharing (prefill_chunked in a
batch-1 paged cache, then decode steps), with a roomy pool and with one small enough to force
evictions and preemptions. Pages are shared while requests overlap, /metrics says so, and every
page comes back once the cached prefixes are dropped."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from kivi_models.generate import decode_step, make_paged_cache, prefill, prefill_chunked
from kivi_serve.request import Request
from kivi_ops.cache.paged_io import copy_sequence
from serve_fixtures import (CONFIG, MAX_SEQ_LEN, METHODS, make_engine, metrics, serving,  # noqa: F401
                            tiny, wait_idle)

SYSTEM = list(range(300, 337))  # 37 tokens: past R = 8 and several 4-token pages, mid-chunk
SUFFIXES = [[7, 8, 9], list(range(400, 411)), [12], list(range(500, 506)), list(range(600, 619)), [5, 6]]
PROMPTS = [SYSTEM + s for s in SUFFIXES] + [SYSTEM[:20] + [1, 2, 3], SYSTEM[:9]]  # shorter shares too
LENGTHS = [14, 9, 17, 11, 6, 13, 10, 8]
PAGE = 4


def reference(tiny, method, ids, max_tokens, chunk, slots=4) -> tuple[list[int], torch.Tensor]:
    """The prompt alone, prefilled in chunks without sharing in a batch-1 paged cache, then copied
    into row 0 of a paged cache of the engine's rows and capacity (its other rows empty) for greedy
    decode steps, as the engine does (a batch-1 decode rounds otherwise than a batch of `slots`
    rows in the paged fp cache's SDPA): (tokens, the logits of each [max_tokens, V])."""
    model, _ = tiny
    caches = [make_paged_cache(model, method=method, batch_size=b, max_seq_len=MAX_SEQ_LEN, page_size=PAGE,
                               num_pages=MAX_SEQ_LEN // PAGE, kivi_config=CONFIG) for b in (1, slots)]
    pages = list(range(caches[0].max_pages_per_seq))
    for cache in caches:
        cache.block_table[0] = torch.tensor(pages, dtype=torch.int32)
    staging, batch = caches
    counts = torch.tensor([1] + [0] * (slots - 1))
    with torch.inference_mode():
        logits = [prefill_chunked(model, staging, ids, chunk)[0]]
        copy_sequence(batch, 0, pages, staging, 0, pages)
        while len(logits) < max_tokens:
            tokens = torch.zeros(slots, dtype=torch.long)
            tokens[0] = logits[-1].argmax()
            logits.append(decode_step(model, batch, tokens, batch.lengths().clone(), counts)[0])
    return [int(x.argmax()) for x in logits], torch.stack(logits)


def check_against_reference(tiny, method, prompts, lengths, got, chunk) -> None:
    for ids, n, tokens in zip(prompts, lengths, got):
        assert tokens == reference(tiny, method, ids, n, chunk)[0], ids


def without_sharing(tiny, method, prompts, lengths, first_alone=True, **options) -> tuple[list, dict]:
    """The same requests through the same engine, prefilled in the same chunks, nothing cached
    (prefix_cache_size=0)."""
    engine = make_engine(tiny, method, **options, prefix_cache_size=0)
    try:
        out = run(engine, prompts, lengths, first_alone)
        assert engine.stats()["prefix_hits"] == 0 and engine.stats()["prefixes_cached"] == 0
    finally:
        engine.close()
    return out


def assert_same_logits(got: dict, want: dict, steps=None) -> None:
    """The logits of every request's first `steps` tokens (None: all), bit for bit (a tiny change in
    a restored window could leave greedy tokens as they are)."""
    assert got.keys() == want.keys()
    for i in got:
        assert torch.equal(torch.stack(got[i][:steps]), torch.stack(want[i][:steps])), i


def run(engine, prompts, lengths, first_alone=True) -> tuple[list[list[int]], dict]:
    """Greedy requests; the first runs alone (it fills the prefix cache), the rest together.
    Returns each one's tokens and {request index: the logits it sampled from, in order}."""
    done = [threading.Event() for _ in prompts]
    reqs, logits = [], collections.defaultdict(list)
    real_advance = engine.executor._advance

    def advance(batch_logits, slots, where):  # the engine thread: rows hold their requests here
        for row_logits, slot in zip(batch_logits, slots):
            rid = engine.snapshot()["rows"][slot]
            if rid is not None:
                logits[[r.id for r in reqs].index(rid)].append(row_logits.clone())
        return real_advance(batch_logits, slots, where)

    engine.executor._advance = advance
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        def emit(kind, payload, i=i):
            if kind == "error":
                raise AssertionError(f"request {i} failed: {payload}")
            if kind == "done":
                done[i].set()
        reqs.append(Request(prompt_ids=list(ids), max_tokens=n, temperature=0, emit=emit))
    if first_alone:
        engine.submit(reqs[0])
        assert done[0].wait(120)
    with engine.lock:  # the engine sees all of them at its next round: the same batches every run
        for r in reqs[first_alone:]:
            engine.submit(r)
    for i, d in enumerate(done):
        assert d.wait(120), f"request {i} never finished: {engine.stats()}"
    return [r.tokens for r in reqs], logits


def assert_every_page_comes_back(engine) -> None:
    """Once idle, only cached prefixes hold pages: dropping them returns every page."""
    engine.placement.blocks.clear_prefixes()
    engine.check()
    snap = engine.snapshot()
    assert snap["pages_free"] == snap["num_pages"]


def watch_sharing(engine) -> list[int]:
    """Record the pages shared by running sequences before every decode step."""
    seen, real_step = [], engine.step_fn

    def step(*args, **kwargs):
        seen.append(engine.snapshot()["pages_shared"])
        engine.check()
        return real_step(*args, **kwargs)

    engine.step_fn = step
    return seen


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("chunk", [PAGE, 2 * PAGE])
def test_shared_prefix_completions_equal_the_chunked_prefill_alone_and_pages_are_shared(tiny, method, chunk):
    engine = make_engine(tiny, method, num_pages=200, page_size=PAGE, prefix_chunk=chunk)
    shared = watch_sharing(engine)
    try:
        got, logits = run(engine, PROMPTS, LENGTHS)
        stats = wait_idle(engine)
        with serving(engine) as url:
            m = metrics(url)
    finally:
        engine.close()
    check_against_reference(tiny, method, PROMPTS, LENGTHS, got, chunk)
    assert_same_logits(logits, without_sharing(tiny, method, PROMPTS, LENGTHS, num_pages=200, page_size=PAGE,
                                               prefix_chunk=chunk)[1])
    assert max(shared) > 0, shared  # overlapping requests held the system prompt's pages together
    # every prompt after the first started from a cached prefix: the longest whole chunks of it
    # that the first had (or later ones added), leaving at least one token to prefill
    assert stats["prefix_hits"] == len(PROMPTS) - 1, stats
    assert stats["prefix_hit_tokens"] >= sum(min(len(SYSTEM), len(p) - 1) // chunk * chunk for p in PROMPTS[1:])
    assert m["kivi_prefix_hits_total"] == stats["prefix_hits"] and m["kivi_cache_pages_shared"] == 0
    assert m["kivi_cache_pages_cached"] == stats["pages_cached"] > 0 == stats["preemptions"]
    # idle: only cached prefixes hold pages; dropping them returns every page
    assert stats["pages_used"] == engine.placement.blocks.num_cached == engine.placement.blocks.num_reclaimable
    assert_every_page_comes_back(engine)


@pytest.mark.parametrize("method", METHODS)
def test_a_small_pool_evicts_cached_prefixes_and_preempts_yet_every_completion_is_unchanged(tiny, method):
    # 6 requests of 41-75 tokens at once in 4 rows, a pool of 28 4-token pages (fp: 112 tokens)
    # or 22 (KIVI: quantized tokens only): cached prefixes are evicted, running requests preempted.
    prompts, lengths = PROMPTS[:6], [30, 24, 28, 20, 22, 26]
    num_pages = 28 if method == "fp" else 22
    engine = make_engine(tiny, method, num_pages=num_pages, page_size=PAGE, prefix_chunk=PAGE, prefix_cache_size=16)
    watch_sharing(engine)
    try:
        got, logits = run(engine, prompts, lengths, first_alone=False)
        stats = wait_idle(engine)
    finally:
        engine.close()
    assert stats["preemptions"] > 0 and engine.snapshot()["evictions"] > 0 and stats["prefix_hits"] > 0, stats
    assert stats["prefixes_cached"] <= 16
    check_against_reference(tiny, method, prompts, lengths, got, PAGE)
    # The prompt's logits (the prefill, alone in the staging cache) bit for bit. Not the decode
    # steps': sharing leaves pages free, so preemptions and rows differ from the run without it,
    # and a decode step's rounding on CPU depends on the row (the paged fp cache's SDPA gives row 3
    # other bits than row 0 for the same sequence).
    unshared_tokens, unshared = without_sharing(tiny, method, prompts, lengths, False, num_pages=num_pages,
                                                page_size=PAGE, prefix_chunk=PAGE)
    assert got == unshared_tokens
    assert_same_logits(logits, unshared, steps=1)
    assert_every_page_comes_back(engine)


@pytest.mark.slow  # a cold Inductor build; the eager engine's shared pages are checked above
def test_the_compiled_decode_step_never_writes_a_shared_page(tiny):
    # The compiled step runs the decomposed append (every row's candidate rows written each call,
    # others to the scratch page): the shared pages must stay as they are there too.
    torch._dynamo.reset()
    prompts, lengths = PROMPTS[:5], LENGTHS[:5]
    engine = make_engine(tiny, "kivi", num_pages=200, page_size=PAGE, prefix_chunk=PAGE, compile=True)
    shared = watch_sharing(engine)
    try:
        assert engine.ready.wait(300)
        got, logits = run(engine, prompts, lengths)
        assert engine.stats()["prefix_hits"] == len(prompts) - 1 and max(shared) > 0
    finally:
        engine.close()
    torch._dynamo.reset()
    unshared_tokens, unshared = without_sharing(tiny, "kivi", prompts, lengths, num_pages=200, page_size=PAGE,
                                                prefix_chunk=PAGE, compile=True)
    assert got == unshared_tokens
    assert_same_logits(logits, unshared)


def tail_copies_bytes(engine) -> int:
    """The bytes of the host copies the runner keeps for cached prefixes (every saved entry is one
    when nothing is swapped out)."""
    assert engine.stats()["swapped"] == 0
    return sum(t.nbytes for tail in engine.runner.saved.values() for t in tail.saved.values())


def test_the_prefix_cache_is_bounded_by_the_bytes_of_its_tails(tiny):
    # 4 distinct 24-token prompts, chunk 8: 3 tails each. A bound of 5 tails keeps 5; the bytes
    # /metrics reports are the bytes of the host copies the runner holds. The default bound is the
    # cache's own bytes.
    prompts = [[1000 + 50 * i + j for j in range(24)] for i in range(4)]
    from kivi_serve.paged_options import PagedServing, largest_tail_bytes, prefix_bytes

    cache = make_paged_cache(tiny[0], method="kivi", batch_size=4, max_seq_len=MAX_SEQ_LEN, page_size=PAGE,
                             num_pages=200, kivi_config=CONFIG)  # the engine's
    tail = largest_tail_bytes(cache, 2 * PAGE, MAX_SEQ_LEN)
    assert prefix_bytes(PagedServing(200, PAGE, 2 * PAGE), cache, MAX_SEQ_LEN) == max(cache.nbytes(), tail)
    engine = make_engine(tiny, "kivi", num_pages=200, page_size=PAGE, prefix_chunk=2 * PAGE, prefix_cache_bytes=5 * tail)
    try:
        with serving(engine) as url:
            for ids in prompts:  # one after the other: the least recently used tails go
                done = threading.Event()
                engine.submit(Request(prompt_ids=ids, max_tokens=2, temperature=0,
                                      emit=lambda kind, payload: kind != "text" and done.set()))
                assert done.wait(60)
            stats = wait_idle(engine)
            held = tail_copies_bytes(engine)
            m = metrics(url)
    finally:
        engine.close()
    assert stats["prefixes_cached"] == 5 and engine.snapshot()["evictions"] == 3 * 4 - 5, stats
    assert m["kivi_prefix_cache_bytes"] == stats["prefix_bytes"] == held <= 5 * tail
    assert len(engine.runner.saved) == 5  # the evicted tails were dropped, not only uncounted
    assert engine.placement.max_prefix_bytes == 5 * tail
    with pytest.raises(ValueError, match=r"--prefix-cache-gib .* holds no cached prefix .* give at least"):
        make_engine(tiny, "kivi", num_pages=200, page_size=PAGE, prefix_chunk=2 * PAGE, prefix_cache_bytes=tail - 1)


def test_bad_prefix_settings_are_refused_naming_the_flag(tiny):
    with pytest.raises(ValueError, match=r"--prefix-chunk must be a positive multiple of the page size \(4 tokens"):
        make_engine(tiny, "kivi", num_pages=20, page_size=4, prefix_chunk=6)
    with pytest.raises(ValueError, match="--prefix-cache-size must be an int >= 0"):
        make_engine(tiny, "fp", num_pages=20, page_size=4, prefix_chunk=4, prefix_cache_size=-1)


ROUNDING = 1e-5  # logits of order 1 summed in another order in fp32: ~1e-7 measured; a quantized token moves them >1e-4


@pytest.mark.parametrize("chunk", [PAGE, 2 * PAGE])
def test_a_chunked_prefill_equals_one_shot_below_R_tokens_and_sees_quantized_keys_from_R(tiny, chunk):
    """docs/serve.md's rule: a chunk attends after its own append, so a prompt of fewer than R
    tokens sees nothing quantized (one-shot's logits up to rounding), one of R tokens sees its R keys
    quantized (the window flushed by the append), one of R + 1 also its oldest value."""
    model, _ = tiny
    R = CONFIG.residual_length

    def last_logits(ids, chunked: bool) -> torch.Tensor:
        cache = make_paged_cache(model, method="kivi", batch_size=1, max_seq_len=MAX_SEQ_LEN, page_size=PAGE,
                                 num_pages=MAX_SEQ_LEN // PAGE, kivi_config=CONFIG)
        cache.block_table[0] = torch.arange(cache.max_pages_per_seq, dtype=torch.int32)
        with torch.inference_mode():
            if chunked:
                return prefill_chunked(model, cache, ids, chunk)[0]
            return prefill(model, cache, torch.tensor([ids]), torch.tensor([len(ids)]))[0]

    for n in (R - 2, R - 1, R, R + 1):
        ids = list(range(300, 300 + n))
        gap = (last_logits(ids, True) - last_logits(ids, False)).abs().max().item()
        assert (gap <= ROUNDING) == (n < R), (n, gap)
