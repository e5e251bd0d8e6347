"""Prefix caching over KIVI blocks (kivi_vllm/prefix_tails.py): a request that starts from a cached
prefix gives the tokens it gives without the hit, and the library's chunked generation's."""

import torch

from conftest import close, greedy_outputs, make_llm
from kivi_ops import KIVIConfig
from kivi_vllm.prefix_tails import TAILS, PrefixTails, boundary_keys
from kivi_vllm.windows import SLOTS
from library_reference import MARGINS, load_patched, prefix_schedules, replay, schedules

KIVI2 = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}
SHARED = [(7 * j + 3) % 256 for j in range(150)]  # 4 full blocks of 32 tokens; boundaries 64 and 128


def test_boundary_keys_name_the_whole_prefix():
    a, b = list(range(200)), list(range(200))
    b[3] = 99
    ka, kb = boundary_keys(a, 64, 200), boundary_keys(b, 64, 200)
    assert len(ka) == 3 and ka[:1] != kb[:1] and ka[2] != kb[2]  # a change before a boundary changes all later keys
    assert boundary_keys(a[:130] + [1] * 70, 64, 200)[:2] == ka[:2]  # and nothing after it does


def test_tails_evict_least_recently_used_but_never_the_kept():
    tails = PrefixTails()
    window = torch.zeros(2, 4, 8)  # 256 bytes; an entry of one layer holds 512
    tails.configure(64, limit_bytes=1024)
    tokens = list(range(256))
    keys = boundary_keys(tokens, 64, 256)
    for key in keys:
        tails.save(key, "layer0", window, window)
    assert tails.bytes == 4 * 512  # saving never evicts: the scheduler may have counted on an entry
    blocks = list(range(100, 108))  # blocks of 32 tokens
    tails.mark(blocks, keys, 0, 192, (0, 200), 32)  # a prefill to 200 tokens: its last 8 past the boundary
    assert tails.longest_hit(tokens, 255, blocks, 32) == 192  # the longest stored boundary <= 255; now most recent
    tails.evict(keep={keys[0]})
    assert tails.bytes == 1024 and set(tails.entries) == {keys[0], keys[2]}
    assert tails.longest_hit(tokens, 150, blocks, 32) == 64
    # A block rewritten past its writer's frontier (another request's prompt ended inside its chunk):
    tails.mark([100, 101, 102, 103], keys, 64, 64, (64, 110), 32)
    assert tails.longest_hit(tokens, 255, blocks, 32) == 64


def _check(model, config, prompt, out, sched):
    tokens = prompt + out
    predicted = replay(model, tokens, len(prompt), sched, config, prefix_chunk=64)
    assert set(predicted) == set(range(len(prompt), len(tokens))), "the schedule does not produce every output"
    wrong = {p: (t, tokens[p], f"margin {MARGINS[p]:.3g}") for p, t in predicted.items() if t != tokens[p]}
    assert not wrong, f"prompt of {len(prompt)}: (library, vLLM) tokens differ at {wrong}"


def test_hits_change_nothing_and_equal_the_library(tiny_llama):
    writer = SHARED + [(5 * j + 1) % 256 for j in range(20)]
    readers = [SHARED + [(3 * j + i) % 256 for j in range(25 + 9 * i)] for i in range(3)]
    SLOTS.trace = []
    llm = make_llm(tiny_llama, KIVI2, enable_prefix_caching=True)
    try:
        assert TAILS.chunk == 64
        first = greedy_outputs(llm, [writer], 24)
        hits = TAILS.hits
        shared = greedy_outputs(llm, readers, 24)  # concurrent readers of the writer's prefix
        assert TAILS.hits - hits == 3, "the readers did not start from the cached prefix"
    finally:
        close(llm)
    trace, SLOTS.trace = SLOTS.trace, None
    sched = schedules(trace)
    assert all(sched[tuple(r)][0][0] == 128 for r in readers), "a reader did not start at the 128-token boundary"
    llm = make_llm(tiny_llama, KIVI2, enable_prefix_caching=True)
    try:
        alone = [greedy_outputs(llm, [r], 24)[0] for r in readers[:1]]  # no cached prefix in a new engine
    finally:
        close(llm)
    assert alone == shared[:1], "a prefix-cache hit changed the output"
    model, config = load_patched(tiny_llama), KIVIConfig(**KIVI2)
    steps = prefix_schedules(trace, 64)
    for prompt, out in zip([writer] + readers, first + shared):
        _check(model, config, prompt, out, steps[tuple(prompt)])


def test_hits_under_chunked_prefill_and_preemption(tiny_llama):
    # An 80-token budget chunks the prompts (their chunks end at the 64-token boundaries) and mixes
    # them with decodes; 9 blocks cannot hold every request, so vLLM preempts, and a recomputed request
    # may start again from a cached prefix (its own, or another request's), as new requests do.
    ps = [SHARED[:100 + 20 * i] + [(13 * j + i) % 256 for j in range(10 + 7 * i)] for i in range(5)]
    SLOTS.trace = []
    llm = make_llm(tiny_llama, KIVI2, enable_prefix_caching=True, max_num_batched_tokens=80,
                   num_gpu_blocks_override=9, max_num_seqs=5, max_model_len=256)
    try:
        outs = greedy_outputs(llm, ps, 40)
    finally:
        close(llm)
    trace, SLOTS.trace = SLOTS.trace, None
    sched = schedules(trace)
    restarts = [c for s in sched.values() for (c, _), (pc, pn) in zip(s[1:], s) if c != pc + pn]
    assert restarts, "no preemption ran"
    prefill_steps = [(c, n, len(p)) for p, s in sched.items() for c, n in s if n > 1]
    assert any(c + n < plen for c, n, plen in prefill_steps), "no prompt was chunked"
    assert all((c + n) % 64 == 0 for c, n, plen in prefill_steps if c + n < plen), "a chunk ended off a boundary"
    assert sum(s[0][0] > 0 for s in sched.values()) >= 3, "too few new requests started from a cached prefix"
    assert any(c > 0 for c in restarts), "no resumed request started from a cached prefix"
    model, config, steps = load_patched(tiny_llama), KIVIConfig(**KIVI2), prefix_schedules(trace, 64)
    for prompt, out in zip(ps, outs):
        _check(model, config, prompt, out, steps[tuple(prompt)])
