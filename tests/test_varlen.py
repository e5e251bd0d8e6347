"""kivi_ops.cache.varlen (the engine-metadata form vLLM's backend calls) against the library's own layer:
requests of a flattened batch, some starting (exact prompt attention), some continuing a chunk,
some decoding, each equal to a batch-1 KIVILayer fed the same chunks; the pools live in one byte
buffer per page (byte_pages) and are written only in the pages the block table gives."""

import math

import pytest
import torch
import torch.nn.functional as F

from kivi_ops import KIVIConfig, KIVILayer, Step, dispatch
from kivi_ops.dispatch import implementations
from kivi_ops.cache.byte_pages import page_bytes, pool_views
from kivi_ops.dispatch import cpu_compiled
from kivi_ops.layout import LayerTensors, QuantParams
from kivi_ops.cache.varlen import varlen_append_attend

H, HQ, D, PS = 2, 4, 64, 32
CONFIG = KIVIConfig(k_bits=2, v_bits=4, group_size=32, residual_length=32)


@pytest.mark.slow  # 5.8 s on the shared 2-core machine
def test_varlen_equals_the_library_layer_per_request():
    torch.manual_seed(0)
    # Three requests' chunk schedules (tokens now per step); request 2 joins at step 1.
    steps = [{0: 40, 1: 5}, {0: 1, 1: 30, 2: 70}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 40}]
    pages_per_req = 4
    num_blocks = 1 + 3 * pages_per_req  # block 0 unused (vLLM's null block)
    buffer = torch.zeros(num_blocks, page_bytes(CONFIG, H, PS, D, torch.float32), dtype=torch.uint8)
    pools = pool_views(buffer, CONFIG, H, PS, D, torch.float32)
    block_table = torch.tensor([[1 + r * pages_per_req + j for j in range(pages_per_req)] for r in range(3)])
    kw, vw = torch.zeros(3, H, 32, D), torch.zeros(3, H, 32, D)
    tensors = LayerTensors(pools["k_codes"], pools["k_scale"], pools["k_zero"], kw, pools["v_codes"],
                           pools["v_scale"], pools["v_zero"], vw, torch.zeros(3, dtype=torch.long))
    params = QuantParams(CONFIG.k_bits, CONFIG.v_bits, CONFIG.group_size, CONFIG.residual_length)
    scale = 1 / math.sqrt(D)
    ref = {r: KIVILayer(CONFIG, 0, batch_size=1, max_seq_len=pages_per_req * PS, num_kv_heads=H, head_dim=D)
           for r in range(3)}
    lengths = {0: 0, 1: 0, 2: 0}
    with dispatch.cpu_kernels("reference"):
        for step in steps:
            reqs = sorted(step)
            n = [step[r] for r in reqs]
            q, k, v = torch.randn(sum(n), HQ, D), torch.randn(sum(n), H, D), torch.randn(sum(n), H, D)
            qsl = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()])
            seq = torch.tensor([lengths[r] + step[r] for r in reqs])
            table = block_table[reqs]
            pos = torch.cat([torch.arange(lengths[r], lengths[r] + step[r]) for r in reqs])
            owner = torch.cat([torch.full((step[r],), i) for i, r in enumerate(reqs)])
            slots = table[owner, pos // PS] * PS + pos % PS
            out = varlen_append_attend(q, k, v, tensors, kw, vw, torch.tensor(reqs), table, qsl, seq, slots, params,
                                       scale)
            for i, r in enumerate(reqs):
                a, b = int(qsl[i]), int(qsl[i + 1])
                qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
                fresh = lengths[r] == 0
                ref[r].append(ks, vs, Step(prefill=fresh))
                want = (F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
                        if fresh else ref[r].attend(qs, Step(), scale))
                torch.testing.assert_close(out[a:b], want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
                lengths[r] += step[r]
    assert buffer[0].count_nonzero() == 0, "a write left the request's pages"


def test_slot_mapping_must_match_the_block_table():
    buffer = torch.zeros(3, page_bytes(CONFIG, H, PS, D, torch.float32), dtype=torch.uint8)
    pools = pool_views(buffer, CONFIG, H, PS, D, torch.float32)
    w = torch.zeros(1, H, 32, D)
    tensors = LayerTensors(pools["k_codes"], pools["k_scale"], pools["k_zero"], w, pools["v_codes"],
                           pools["v_scale"], pools["v_zero"], w, torch.zeros(1, dtype=torch.long))
    params = QuantParams(2, 4, 32, 32)
    x = torch.randn(4, H, D)
    with pytest.raises(ValueError, match="slot_mapping does not match block_table"):
        varlen_append_attend(torch.randn(4, HQ, D), x, x, tensors, w, w, torch.tensor([0]), torch.tensor([[1, 2]]),
                             torch.tensor([0, 4]), torch.tensor([4]), torch.tensor([0, 1, 2, 3]), params, 0.125)


def test_pool_views_refuse_a_buffer_of_another_size():
    with pytest.raises(ValueError, match="buffer must hold"):
        pool_views(torch.zeros(2, 100, dtype=torch.uint8), CONFIG, H, PS, D, torch.float32)


@pytest.mark.slow  # an Inductor compile: 20-90 s on the shared 2-core machine
@pytest.mark.parametrize("rows", [[2, 0, 3], [0, 1, 2]])  # windows gathered; the pools' first rows, in place
def test_compiled_decode_attention_pads_to_buckets_and_matches_the_reference(rows):
    """Decode rows under the compiled CPU kernels (the batch padded to the window pool's slots, the
    table to a power of two pages): the reference's outputs within the compiled attention's
    tolerance (summation order, tests/test_cpu_compiled.py), the same bytes written (appends are
    the reference in both), and nothing written outside the rows' pages."""
    torch.manual_seed(1)
    lengths, slots, pages = [33, 64, 95], 4, 4
    params = QuantParams(CONFIG.k_bits, CONFIG.v_bits, CONFIG.group_size, CONFIG.residual_length)

    def state():
        buffer = torch.zeros(1 + 3 * pages, page_bytes(CONFIG, H, PS, D, torch.float32), dtype=torch.uint8)
        pools = pool_views(buffer, CONFIG, H, PS, D, torch.float32)
        kw, vw = torch.zeros(slots, H, 32, D), torch.zeros(slots, H, 32, D)
        return buffer, kw, vw, LayerTensors(pools["k_codes"], pools["k_scale"], pools["k_zero"], kw, pools["v_codes"],
                                            pools["v_scale"], pools["v_zero"], vw, torch.zeros(3, dtype=torch.long))

    table = torch.tensor([[1 + r * pages + j for j in range(pages)] for r in range(3)])
    runs = {}
    for kernels in ("reference", "compiled"):
        buffer, kw, vw, tensors = state()
        g = torch.Generator().manual_seed(0)
        outs = []
        with dispatch.cpu_kernels(kernels):
            for step, n in enumerate([lengths, [1, 1, 1], [1, 1, 1]]):
                before = [0, 0, 0] if step == 0 else [sum(x) for x in zip(lengths, [step - 1] * 3)]
                q, k, v = (torch.randn(sum(n), h, D, generator=g) for h in (HQ, H, H))
                qsl = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()])
                seq = torch.tensor([b + c for b, c in zip(before, n)])
                pos = torch.cat([torch.arange(b, b + c) for b, c in zip(before, n)])
                owner = torch.cat([torch.full((c,), i) for i, c in enumerate(n)])
                outs.append(varlen_append_attend(q, k, v, tensors, kw, vw, torch.tensor(rows), table, qsl, seq,
                                                 table[owner, pos // PS] * PS + pos % PS, params, 1 / math.sqrt(D)))
        runs[kernels] = buffer, kw, vw, outs
    (buf_r, kw_r, vw_r, out_r), (buf_c, kw_c, vw_c, out_c) = runs["reference"], runs["compiled"]
    assert torch.equal(buf_r, buf_c) and torch.equal(kw_r, kw_c) and torch.equal(vw_r, vw_c)
    assert buf_c[0].count_nonzero() == 0
    compiled = cpu_compiled._signatures[implementations.form("attend", "decomposed_fused", paged=True)]
    assert {sig for sig in compiled if f"{(slots, HQ, 1, D)}" in str(sig)}, "the padded batch never ran compiled"
    for got, want in zip(out_c[1:], out_r[1:]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
