"""KIVICache: streaming policy, fused attention, GQA, batching, compile/export, errors, memory."""

import math

import pytest
import torch
import torch.nn.functional as F

from kivi_ops import KIVICache, KIVIConfig, Step, fake_quantize


def make_cache(cfg, *, B=1, H=3, S=256, D=64, layers=1, dtype=torch.float32):
    return KIVICache(cfg, num_layers=layers, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                     dtype=dtype, device="cpu")


class PolicyReference:
    """The paper's streaming policy, written token by token from Algorithm 1, independent of the
    cache's ring-buffer bookkeeping: keys are fake-quantized R at a time when the residual fills,
    a value is fake-quantized when it leaves the window of the last R tokens."""

    def __init__(self, cfg):
        self.cfg, self.keys, self.values, self.quantized_keys = cfg, [], [], 0

    def push(self, k, v):  # k, v: [H, D]
        c = self.cfg
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) - self.quantized_keys == c.residual_length:
            block = torch.stack(self.keys[self.quantized_keys:], dim=1)
            block = fake_quantize(block, c.k_bits, c.group_size, "channel")
            self.keys[self.quantized_keys:] = list(block.unbind(1))
            self.quantized_keys = len(self.keys)
        leaving = len(self.values) - c.residual_length - 1
        if leaving >= 0:
            self.values[leaving] = fake_quantize(self.values[leaving][:, None], c.v_bits, c.group_size, "token")[:, 0]

    def state(self):
        return torch.stack(self.keys, dim=1), torch.stack(self.values, dim=1)


def attention_over(query, keys, values, scale, causal_offset=None):
    """Plain softmax attention with GQA by repeat_interleave (the reference the op must match)."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, dim=1)
    v = values.float().repeat_interleave(groups, dim=1)
    scores = query.float() @ k.transpose(-1, -2) * scale
    if causal_offset is not None:
        q_pos = causal_offset + torch.arange(query.shape[2])
        scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > q_pos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_streaming_token_by_token_matches_policy_over_ten_flushes():
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16)
    B, H, D, steps = 2, 3, 64, 175  # 10 key flushes for sequence 0
    cache = make_cache(cfg, B=B, H=H, S=steps, D=D)
    refs = [PolicyReference(cfg) for _ in range(B)]
    torch.manual_seed(0)
    for step in range(steps):
        k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
        counts = torch.tensor([1, int(step % 3 != 0)])  # sequence 1 skips every third step
        cache.layers[0].append(k, v, Step(counts=counts))
        for b in range(B):
            if counts[b]:
                refs[b].push(k[b, :, 0], v[b, :, 0])
        if step % 7 == 0 or step == steps - 1:
            keys, values = cache.layers[0].dequantized()
            for b in range(B):
                if not refs[b].keys:
                    assert int(cache.lengths()[b]) == 0
                    continue
                rk, rv = refs[b].state()
                n = rk.shape[1]
                assert int(cache.lengths()[b]) == n
                assert torch.equal(keys[b, :, :n], rk) and torch.equal(values[b, :, :n], rv)
                assert (keys[b, :, n:] == 0).all()
    assert refs[0].quantized_keys == 160


@pytest.mark.parametrize("chunks", [[100], [37, 1, 50, 12], [16, 16, 16, 52]])
def test_prefill_and_chunks_follow_algorithm_1(chunks):
    cfg = KIVIConfig(k_bits=4, v_bits=2, group_size=8, residual_length=32)
    total = sum(chunks)
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, total, 64), torch.randn(1, 2, total, 64)
    cache = make_cache(cfg, H=2)
    start = 0
    for n in chunks:
        cache.layers[0].append(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    keys, values = cache.layers[0].dequantized()
    # Prefill split: keys quantize the first L - L mod R tokens, values all but the last R.
    nqk, nqv = total - total % 32, total - 32
    assert torch.equal(keys[:, :, :nqk], fake_quantize(k[:, :, :nqk], 4, 8, "channel"))
    assert torch.equal(keys[:, :, nqk:], k[:, :, nqk:])
    assert torch.equal(values[:, :, :nqv], fake_quantize(v[:, :, :nqv], 2, 8, "token"))
    assert torch.equal(values[:, :, nqv:], v[:, :, nqv:])


@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("q_len", [1, 5])
def test_attend_equals_softmax_over_dequantized(q_heads, kv_heads, q_len):
    cfg = KIVIConfig(group_size=32, residual_length=64)
    torch.manual_seed(2)
    cache = make_cache(cfg, B=2, H=kv_heads, S=2200)
    n = 2100  # spans several of the reference's 1024-token softmax blocks
    cache.layers[0].append(torch.randn(2, kv_heads, n, 64), torch.randn(2, kv_heads, n, 64))
    query = torch.randn(2, q_heads, q_len, 64)
    out = cache.layers[0].attend(query)
    keys, values = cache.layers[0].dequantized()
    expected = attention_over(query, keys, values, 1 / 8, causal_offset=n - q_len)
    # fp32 with one online softmax vs one softmax: error is a few ulps of the output scale.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_residual_covering_everything_is_exact_attention():
    cfg = KIVIConfig(group_size=32, residual_length=256)
    torch.manual_seed(3)
    k, v = torch.randn(1, 3, 200, 64), torch.randn(1, 3, 200, 64)
    cache = make_cache(cfg)
    cache.layers[0].append(k[:, :, :150], v[:, :, :150])
    for t in range(150, 200):
        cache.layers[0].append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    query = torch.randn(1, 9, 1, 64)
    expected = F.scaled_dot_product_attention(query, k, v, enable_gqa=True)
    torch.testing.assert_close(cache.layers[0].attend(query), expected, rtol=1e-5, atol=1e-5)
    keys, values = cache.layers[0].dequantized()
    assert torch.equal(keys, k) and torch.equal(values, v)


def test_batch_of_different_lengths_equals_each_alone():
    cfg = KIVIConfig(group_size=8, residual_length=16)
    torch.manual_seed(4)
    lengths = [40, 7, 23]
    n = max(lengths)
    k, v = torch.randn(3, 3, n, 64), torch.randn(3, 3, n, 64)
    batched = make_cache(cfg, B=3, S=64)
    batched.layers[0].append(k, v, Step(counts=torch.tensor(lengths)))
    q_prefill = torch.randn(3, 9, n, 64)
    out_prefill = batched.layers[0].attend(q_prefill, Step(counts=torch.tensor(lengths)))
    steps = [(torch.randn(3, 3, 1, 64), torch.randn(3, 3, 1, 64), torch.randn(3, 9, 1, 64)) for _ in range(12)]
    outs = []
    for sk, sv, sq in steps:
        batched.layers[0].append(sk, sv)
        outs.append(batched.layers[0].attend(sq))
    for b, length in enumerate(lengths):
        alone = make_cache(cfg, B=1, S=64)
        alone.layers[0].append(k[b:b + 1, :, :length], v[b:b + 1, :, :length])
        torch.testing.assert_close(out_prefill[b:b + 1, :, :length], alone.layers[0].attend(q_prefill[b:b + 1, :, :length]),
                                   rtol=1e-6, atol=1e-6)
        assert (out_prefill[b, :, length:] == 0).all()  # padded query rows
        for (sk, sv, sq), out in zip(steps, outs):
            alone.layers[0].append(sk[b:b + 1], sv[b:b + 1])
            torch.testing.assert_close(out[b:b + 1], alone.layers[0].attend(sq[b:b + 1]), rtol=1e-6, atol=1e-6)
        for got, want in zip(batched.layers[0].dequantized(), alone.layers[0].dequantized()):
            assert torch.equal(got[b:b + 1, :, :length + 12], want)


def test_padding_never_enters_statistics():
    cfg = KIVIConfig(group_size=8, residual_length=16)
    k, v = torch.randn(2, 3, 40, 64), torch.randn(2, 3, 40, 64)
    k[1, :, 20:] = 1e6  # huge padding values would wreck the scales if they were used
    v[1, :, 20:] = 1e6
    cache = make_cache(cfg, B=2, S=64)
    cache.layers[0].append(k, v, Step(counts=torch.tensor([40, 20])))
    keys, values = cache.layers[0].dequantized()
    assert keys[1].abs().max() < 100 and values[1].abs().max() < 100
    assert int(cache.lengths()[1]) == 20


def test_opcheck_cache_ops():
    cfg = KIVIConfig(group_size=8, residual_length=16)
    cache = make_cache(cfg, B=2, S=64)
    cache.layers[0].append(torch.randn(2, 3, 20, 64), torch.randn(2, 3, 20, 64))
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    args = (*layer, torch.randn(2, 3, 3, 64), torch.randn(2, 3, 3, 64), torch.tensor([3, 1]), *params)
    torch.library.opcheck(torch.ops.kivi.cache_append.default, args)
    q = torch.randn(2, 9, 2, 64)
    torch.library.opcheck(torch.ops.kivi.cache_attend.default, (q, *layer, None, *params, 0.125))


def decode_step(cache, layer, k, v, q):
    cache.layers[layer].append(k, v)
    return cache.layers[layer].attend(q)


def op_decode_step(cache, k, v, q):
    """decode_step through the kivi ops themselves (what CUDA runs; on CPU the cache's compiled
    step runs the decomposed forms instead, kivi_ops/dispatch/__init__.py)."""
    params = cache.layers[0].params
    torch.ops.kivi.cache_append(*cache.layers[0].tensors(), k, v, None, *params)
    return torch.ops.kivi.cache_attend(q, *cache.layers[0].tensors(), None, *params, 1 / math.sqrt(cache.head_dim))


def compiled_steps_match_eager(step_fn, *, rtol=0.0, atol=0.0):
    """20 compiled decode steps of step_fn(cache, k, v, q) after a 30-token prompt (crossing the
    key flushes at 32 and 48) against eager decode_step on a twin cache; returns the two caches
    and Inductor's code for the step."""
    from torch._inductor.utils import run_and_get_code

    cfg = KIVIConfig(group_size=8, residual_length=16)
    eager, compiled_cache = make_cache(cfg, S=128), make_cache(cfg, S=128)
    torch.manual_seed(5)
    prompt = torch.randn(1, 3, 30, 64), torch.randn(1, 3, 30, 64)
    eager.layers[0].append(*prompt)
    compiled_cache.layers[0].append(*prompt)
    step, codes = torch.compile(step_fn, fullgraph=True), []
    for i in range(20):
        k, v, q = torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 9, 1, 64)
        want = decode_step(eager, 0, k, v, q)
        if i == 0:
            got, codes = run_and_get_code(step, compiled_cache, k, v, q)
        else:
            got = step(compiled_cache, k, v, q)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return eager, compiled_cache, "\n".join(codes)


def test_compiled_decode_step_matches_eager_without_cache_copies():
    eager, compiled_cache, code = compiled_steps_match_eager(op_decode_step)
    for a, b in zip(eager.layers[0].tensors().kivi, compiled_cache.layers[0].tensors().kivi):
        assert torch.equal(a, b)
    assert "torch.ops.kivi.cache_append" in code and "torch.ops.kivi.cache_attend" in code, code
    # Functionalization of the mutating op must be re-inplaced: the generated code may not clone
    # or copy any cache buffer (each would be a full-cache copy per step).
    assert "clone" not in code and "copy_" not in code, code


@pytest.mark.slow  # a cold Inductor build; test_model.py's compiled decode checks the same forms in a model
def test_compiled_cache_decode_step_is_decomposed_and_matches_eager():
    # The cache's own compiled CPU step runs the decomposed forms inline (kivi_ops/dispatch/__init__.py):
    # the append is bit-exact; attention differs from the eager op (the reference) only in the
    # order of its fp32 sums, within the tolerance justified in test_decomposed.py.
    from test_decomposed import ATOL, RTOL

    eager, compiled_cache, code = compiled_steps_match_eager(
        lambda cache, k, v, q: decode_step(cache, 0, k, v, q), rtol=RTOL, atol=ATOL)
    for (name, a), (_, b) in zip(eager.layers[0].named_buffers(), compiled_cache.layers[0].named_buffers()):
        assert torch.equal(a, b), name
    assert "def call(" in code  # Inductor compiled the step
    assert "torch.ops.kivi" not in code, code


def test_export_keeps_cache_ops():
    cfg = KIVIConfig(group_size=8, residual_length=16)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cache = make_cache(cfg, S=64)

        def forward(self, k, v, q):
            return decode_step(self.cache, 0, k, v, q)

    ep = torch.export.export(Step(), (torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 9, 1, 64)))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("kivi.cache_append" in t for t in targets) and any("kivi.cache_attend" in t for t in targets)


def test_append_past_capacity_raises_before_writing():
    cfg = KIVIConfig(group_size=8, residual_length=16)
    cache = make_cache(cfg, S=40)
    cache.layers[0].append(torch.randn(1, 3, 35, 64), torch.randn(1, 3, 35, 64))
    before = [b.clone() for b in cache.layers[0].buffers()]
    with pytest.raises(ValueError, match="cache is full: sequence 0 holds 35 tokens and appending 6 would exceed max_seq_len=40"):
        cache.layers[0].append(torch.randn(1, 3, 6, 64), torch.randn(1, 3, 6, 64))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layers[0].buffers()))


def test_check_room_raises_before_a_compiled_append():
    # Compiled CPU appends run the decomposed form, which cannot raise (KIVICache.check_room): a
    # compiled loop asks check_room first, which raises before anything is written.
    cfg = KIVIConfig(group_size=8, residual_length=16)
    cache = make_cache(cfg, B=2, S=20)
    cache.layers[0].append(torch.randn(2, 3, 20, 64), torch.randn(2, 3, 20, 64), Step(counts=torch.tensor([20, 19])))
    before = [b.clone() for b in cache.layers[0].buffers()]
    cache.layers[0].check_room(1, torch.tensor([0, 1]))  # a row that appends nothing may be full
    with pytest.raises(ValueError, match="cache is full: sequence 0 holds 20 tokens and appending 1 would exceed max_seq_len=20"):
        cache.layers[0].check_room(1)
    with pytest.raises(ValueError, match="cache is full: sequence 1 holds 19 tokens and appending 2 would exceed max_seq_len=20"):
        cache.layers[0].check_room(2, torch.tensor([0, 2]))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layers[0].buffers()))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda c: c.layers[0].append(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)), r"key must have shape \[1, 3, tokens, 64\]"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 2, 64)), "key and value must have the same shape"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 1, 64).half(), torch.randn(1, 3, 1, 64)), "key must have the cache dtype"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64).double()), "value must have the cache dtype"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 64), torch.randn(1, 3, 64)), "key must be a 4-D tensor"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64), Step(counts=torch.tensor([3]))), r"counts must lie in \[0, 2\]"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64), Step(counts=torch.tensor([1.0]))), "counts must be an int64"),
        (lambda c: c.layers[0].attend(torch.randn(1, 4, 1, 64)), r"query heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (lambda c: c.layers[0].attend(torch.randn(1, 9, 1, 32)), r"query must have shape"),
        (lambda c: c.layers[0].append(torch.randn(1, 3, 1, 64, device="meta"), torch.randn(1, 3, 1, 64)), "key must be on the cache device"),
    ],
)
def test_bad_cache_input_raises_clear_errors(call, match):
    cache = make_cache(KIVIConfig(group_size=8, residual_length=16))
    with pytest.raises(ValueError, match=match):
        call(cache)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        make_cache(KIVIConfig(), S=0)
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 8"):
        make_cache(KIVIConfig(), D=60)
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_cache(KIVIConfig(), dtype=torch.float64)
    with pytest.raises(TypeError, match="config must be a KIVIConfig"):
        KIVICache({}, num_layers=1, batch_size=1, max_seq_len=8, num_kv_heads=1, head_dim=64, dtype=torch.float32, device="cpu")


def expected_nbytes(cfg, B, H, S, D, layers, dtype_bytes):
    per_token_codes = D * cfg.k_bits // 8 + D * cfg.v_bits // 8
    k_params = 2 * math.ceil(S / cfg.group_size) * D * dtype_bytes
    v_params = 2 * S * (D // min(cfg.group_size, D)) * dtype_bytes
    residual = 2 * min(cfg.residual_length, S) * D * dtype_bytes
    return layers * (B * H * (S * per_token_codes + k_params + v_params + residual) + B * 8)


@pytest.mark.parametrize("G,R,tokens,ratio", [(32, 128, 4096, 4.57), (32, 128, 32768, 5.22), (128, 128, 4096, 5.82), (128, 128, 32768, 6.92)])
def test_nbytes_exact_accounting_and_ratio(G, R, tokens, ratio):
    cfg = KIVIConfig(group_size=G, residual_length=R)
    cache = make_cache(cfg, B=1, H=1, S=tokens, D=128, dtype=torch.float16)
    assert cache.nbytes() == expected_nbytes(cfg, 1, 1, tokens, 128, 1, 2)
    assert cache.fp16_nbytes() / cache.nbytes() == pytest.approx(ratio, abs=0.01)


def test_residual_not_a_multiple_of_group_is_rejected():
    # G=128 with R=32 cannot flush keys in whole per-channel groups (Algorithm 1 needs R % G == 0).
    with pytest.raises(ValueError, match="residual_length must be a positive multiple of group_size=128"):
        KIVIConfig(group_size=128, residual_length=32)


def test_load_row_copies_one_sequence_and_leaves_the_others():
    cfg = KIVIConfig(group_size=8, residual_length=16)
    big, small = make_cache(cfg, S=64, B=3), make_cache(cfg, S=64, B=1)
    torch.manual_seed(0)
    big.layers[0].append(torch.randn(3, 3, 20, 64), torch.randn(3, 3, 20, 64))
    small.layers[0].append(torch.randn(1, 3, 37, 64), torch.randn(1, 3, 37, 64))
    before = {name: t.clone() for name, t in big.state().items()}
    big.load_row(1, small)
    for name, t in big.state().items():
        assert torch.equal(t[1], small.state()[name][0]), name
        assert torch.equal(t[0], before[name][0]) and torch.equal(t[2], before[name][2]), name
    # Row 1 now attends like the source: the same stored values; only the fp32 sums' order may
    # differ with the batch size (torch's default fp32 tolerance).
    q = torch.randn(1, 9, 1, 64)
    torch.testing.assert_close(big.layers[0].attend(q.expand(3, -1, -1, -1).contiguous())[1:2], small.layers[0].attend(q))
    with pytest.raises(ValueError, match="same kind"):
        big.load_row(0, make_cache(KIVIConfig(group_size=8, residual_length=16, sink_tokens=2), S=64, B=1))


# Every option that adds per-row state: sink tokens, OTT's outlier and spill pools, dense-and-sparse stores.
REORDER_CONFIGS = [KIVIConfig(group_size=8, residual_length=8),
                   KIVIConfig(group_size=8, residual_length=8, sink_tokens=2, outlier_tokens=2, outlier_skip_layers=0,
                              sparse_outliers=0.05)]


@pytest.mark.parametrize("cfg", REORDER_CONFIGS)
def test_reorder_cache_moves_every_row_in_place_as_beam_search_needs(cfg):
    # transformers' beam search calls reorder_cache(beam_idx) after each step: row b must become
    # row beam_idx[b] in every per-row buffer, with quantized groups already flushed (20 tokens,
    # G = R = 8), and the buffers must stay the same tensors (compiled steps hold their addresses).
    cache = make_cache(cfg, S=64, B=3, H=2, layers=3)  # B != H: a per-head buffer cannot pass as per-row
    torch.manual_seed(0)
    for layer in cache.layers:
        layer.append(torch.randn(3, 2, 20, 64), torch.randn(3, 2, 20, 64),
                     Step(counts=torch.tensor([20, 13, 17]), prefill=True))
    rows = {(i, name): t for i, layer in enumerate(cache.layers) for name, t in layer.row_tensors().items()}
    assert all(t.shape[0] == 3 for t in rows.values())
    before = {key: t.clone() for key, t in rows.items()}
    addresses = {key: t.data_ptr() for key, t in rows.items()}
    q = torch.randn(1, 4, 1, 64)
    attended = [layer.attend(q.expand(3, -1, -1, -1).contiguous()) for layer in cache.layers]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    for i, layer in enumerate(cache.layers):
        for name, t in layer.row_tensors().items():
            assert t.data_ptr() == addresses[i, name], name
            for row, source in enumerate([2, 0, 0]):
                assert torch.equal(t[row], before[i, name][source]), (i, name, row)
        again = layer.attend(q.expand(3, -1, -1, -1).contiguous())
        torch.testing.assert_close(again, attended[i][[2, 0, 0]])
    assert cache.lengths().tolist() == [17, 20, 20]


def test_reorder_cache_refuses_bad_indices_and_batch_resizing():
    cache = make_cache(KIVIConfig(group_size=8, residual_length=8), S=64, B=2)
    for bad in (torch.tensor([0]), torch.tensor([0.0, 1.0]), [0, 1]):
        with pytest.raises(ValueError, match=r"beam_idx must be an integer tensor of shape \[2\]"):
            cache.reorder_cache(bad)
    with pytest.raises(ValueError, match="fixed batch_size"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match="fixed batch_size"):
        cache.batch_select_indices(torch.tensor([0]))


def test_paged_cache_refuses_beam_search_naming_num_beams():
    from kivi_ops.cache.paged import PagedKIVICache
    paged = PagedKIVICache(KIVIConfig(group_size=8, residual_length=16), num_layers=1, batch_size=2, num_pages=4,
                           page_size=16, max_pages_per_seq=2, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="num_beams"):
        paged.reorder_cache(torch.tensor([1, 0]))
