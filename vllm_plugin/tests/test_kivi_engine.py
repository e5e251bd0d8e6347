"""vLLM + KIVI against the library's own KIVI generation, token for token, on the schedules vLLM
really ran (windows.SLOTS.trace): concurrency, chunked prefill, batches mixing prefill and decode,
and preemption by recompute."""

import pytest

from conftest import close, greedy_outputs, make_llm
from kivi_ops import KIVIConfig
from kivi_vllm.windows import SLOTS
from library_reference import MARGINS, load_patched, replay, schedules

KIVI2 = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}


def prompts(n, base=20, step=17):
    return [[(11 * i + 5 * j + 3) % 256 for j in range(base + step * i)] for i in range(n)]


def run_and_replay(model_dir, kivi, ps, max_tokens, checked=None, **options):
    """checked: how many output tokens of each request must equal the library's (default all)."""
    SLOTS.trace = []
    llm = make_llm(model_dir, kivi, **options)
    try:
        outs = greedy_outputs(llm, ps, max_tokens)
    finally:
        close(llm)
    trace, SLOTS.trace = SLOTS.trace, None
    model, config = load_patched(model_dir), KIVIConfig(**kivi)
    sched = schedules(trace)
    for p, out in zip(ps, outs):
        tokens = p + out
        predicted = replay(model, tokens, len(p), sched[tuple(p)], config)
        assert set(predicted) == set(range(len(p), len(tokens))), "the schedule does not produce every output"
        wrong = {pos: (tok, tokens[pos], f"top-2 margin {MARGINS[pos]:.3g}") for pos, tok in predicted.items()
                 if tok != tokens[pos] and pos < len(p) + (max_tokens if checked is None else checked)}
        assert not wrong, f"prompt of {len(p)}: (library, vLLM) tokens differ at positions {wrong}"
    return trace, sched


def test_llama_chunked_mixed_preempted(tiny_llama):
    # A 48-token budget splits prompts into chunks and mixes them with other requests' decodes;
    # 8 usable blocks of 32 tokens (one max_model_len) cannot hold six requests of 60..145 tokens: vLLM preempts.
    trace, sched = run_and_replay(tiny_llama, KIVI2, prompts(6), 40, max_num_batched_tokens=48,
                                  num_gpu_blocks_override=9, max_num_seqs=6, max_model_len=256)
    chunks = [(c, n) for s in sched.values() for c, n in s]
    assert any(c > 0 and n > 1 for c, n in chunks), "no chunked prefill ran"
    assert any({n == 1 for _, _, n in step} == {True, False} for step in trace), "no mixed prefill/decode batch"
    assert any(c == 0 for s in sched.values() for c, _ in s[1:]), "no preemption ran"


def test_qwen2_concurrent(tiny_qwen2):
    run_and_replay(tiny_qwen2, {"k_bits": 4, "v_bits": 2, "group_size": 32, "residual_length": 64}, prompts(5), 48)
