"""The paged KIVI cache (kivi_ops/cache/paged.py) against the static KIVICache: for every sequence, the
same attention outputs and dequantized state, bit for bit (torch.equal), decode and prefill,
ragged batches, rows flushing at different steps, with pages handed out shuffled
(tests/paged_helpers.py) and garbage in the block-table entries a row does not use. Also: the
options (nuq levels, pre-RoPE keys) and the refused ones, torch.compile as one graph, opcheck of
the two paged ops, swapping a sequence out and back, pages_needed and the contract's errors."""

import math

import pytest
import torch

from kivi_ops import KIVIConfig, Step, dispatch
from kivi_ops.cache.paged import PagedKIVICache, PagedKIVILayer, pages_needed
from paged_helpers import ShuffledPages, append_both, assert_same_state, make_pair

CFG = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16)


def _rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def run_equal(cfg, *, B=3, H=2, HQ=4, D=32, page_size=16, max_pages=6, prompt=(20, 5, 37), steps=24,
              dtype=torch.float32, seed=0, **kwargs):
    """A ragged prompt (prefill attention is exact: checked through the stored state), then decode
    steps where row 1 skips every third step (a free slot: counts 0) and a 3-token chunk every
    seventh: attention and state equal the static cache's after every step."""
    static, paged, manager = make_pair(cfg, B=B, H=H, D=D, page_size=page_size, max_pages=max_pages, dtype=dtype,
                                       seed=seed, **kwargs)
    g = torch.Generator().manual_seed(seed)
    n = max(prompt)
    counts = torch.tensor(prompt[:B])
    append_both(static, paged, manager, _rand(g, B, H, n, D, dtype=dtype), _rand(g, B, H, n, D, dtype=dtype), counts,
                prefill=True)
    assert_same_state(static, paged)
    for step in range(steps):
        q_len = 3 if step % 7 == 6 else 1
        c = torch.tensor([q_len, q_len if step % 3 else 0, q_len][:B])
        append_both(static, paged, manager, _rand(g, B, H, q_len, D, dtype=dtype), _rand(g, B, H, q_len, D, dtype=dtype),
                    c)
        query = _rand(g, B, HQ, q_len, D, dtype=dtype)
        want = static.layers[0].attend(query, Step(counts=c))
        got = paged.layers[0].attend(query, Step(counts=c))
        assert torch.equal(got, want), step
        assert_same_state(static, paged)
    assert int(paged.lengths().max()) > 2 * cfg.residual_length  # several key flushes happened
    return static, paged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_static_bit_for_bit(dtype):
    run_equal(CFG, dtype=dtype)


def test_paged_equals_static_with_a_page_per_residual_window_and_4_bits():
    cfg = KIVIConfig(k_bits=4, v_bits=2, group_size=8, residual_length=32)
    run_equal(cfg, page_size=8, max_pages=12, prompt=(40, 70, 9), steps=20)


def test_paged_equals_static_with_nuq_levels_and_pre_rope_keys():
    levels = (0.0, 0.4, 2.2, 3.0)
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, pre_rope=True, key_levels=(levels,),
                     value_levels=((0.0, 1.0, 1.5, 3.0),))
    D = 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    run_equal(cfg, D=D, rope_inv_freq=inv_freq, rope_scaling=0.9, steps=12)


@pytest.mark.slow
def test_paged_equals_static_with_the_compiled_cpu_forms():
    """Eager CPU decode with the default kernels: the decomposed forms compiled per op by Inductor
    (the paged append writes through the block table; the paged attention reads the gathered
    pages)."""
    with dispatch.cpu_kernels("compiled"):
        run_equal(CFG, B=2, prompt=(20, 37), steps=18)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_decode_step_is_one_graph_and_equals_static(backend):
    """torch.compile(fullgraph=True) of a decode step (append + attend) on the paged layer: one
    graph, no kivi op inside (the CPU compile forms are traced), the static step's bits under the
    same backend. aot_eager runs the traced decomposed forms op by op (fast); Inductor fuses them."""
    B, H, HQ, D = 2, 2, 4, 32
    static, paged, manager = make_pair(CFG, B=B, H=H, D=D, page_size=16, max_pages=4)
    g = torch.Generator().manual_seed(5)
    append_both(static, paged, manager, _rand(g, B, H, 30, D), _rand(g, B, H, 30, D), torch.tensor([30, 17]),
                prefill=True)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    def step(layer, key, value, query):
        layer.append(key, value)
        return layer.attend(query)

    compiled_paged = torch.compile(step, fullgraph=True, backend=counting)
    compiled_static = torch.compile(step, fullgraph=True, backend=backend)
    with torch.no_grad():
        for i in range(6):  # rows 0 and 1 complete a key window at different steps (32, 32 + 16)
            manager.reserve([1, 1])
            k, v, q = _rand(g, B, H, 1, D), _rand(g, B, H, 1, D), _rand(g, B, HQ, 1, D)
            got = compiled_paged(paged.layers[0], k, v, q)
            want = compiled_static(static.layers[0], k, v, q)
            assert torch.equal(got, want), i
            assert_same_state(static, paged)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert not any("kivi" in t for t in targets)


def _allocated_elements(code: str) -> int:
    """Elements of every buffer Inductor's generated code allocates (empty_strided_cpu((shape), ...))."""
    import re

    return sum(math.prod(int(x) for x in shape.split(",") if x.strip())
               for shape in re.findall(r"empty_strided_cpu\(\(([0-9, ]*)\)", code))


@pytest.mark.slow
def test_compiled_paged_decode_step_copies_no_pages():
    """Inductor's code for the paged decode step (append + attend) reads the pages through the
    block table inside its loops: it allocates no more than the static step's code does (a gather
    of the pages into the static layout would add [B, H, S, ...] buffers of codes and scales:
    paged_layout.indexed_view vs static_view), and gives the static step's bits."""
    from torch._inductor.utils import run_and_get_code

    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16)
    B, H, HQ, D = 3, 2, 4, 32
    static, paged, manager = make_pair(cfg, B=B, H=H, D=D, page_size=16, max_pages=16)  # S = 256
    g = torch.Generator().manual_seed(7)
    append_both(static, paged, manager, _rand(g, B, H, 70, D), _rand(g, B, H, 70, D), torch.tensor([70, 41, 66]),
                prefill=True)
    manager.reserve([1] * B)

    def step(layer, key, value, query):
        layer.append(key, value)
        return layer.attend(query)

    k, v, q = _rand(g, B, H, 1, D), _rand(g, B, H, 1, D), _rand(g, B, HQ, 1, D)
    with torch.no_grad():
        want, static_code = run_and_get_code(torch.compile(step, fullgraph=True), static.layers[0], k, v, q)
        got, paged_code = run_and_get_code(torch.compile(step, fullgraph=True), paged.layers[0], k, v, q)
    assert torch.equal(got, want)
    assert_same_state(static, paged)
    paged_elements, static_elements = (_allocated_elements("\n".join(c)) for c in (paged_code, static_code))
    assert paged_elements <= static_elements
    # The bound means something: gathering the two code pools alone (2 bits: D / 4 bytes a token)
    # would allocate more than the static step's code does in all.
    S = 256
    assert static_elements < 2 * B * H * S * D // 4


def test_opcheck_paged_ops():
    _, paged, manager = make_pair(CFG, B=2, H=2, D=32, page_size=16, max_pages=4)
    layer = paged.layers[0]
    g = torch.Generator().manual_seed(6)
    manager.reserve([33, 20])
    key, value, counts = _rand(g, 2, 2, 33, 32), _rand(g, 2, 2, 33, 32), torch.tensor([33, 20])
    torch.library.opcheck(torch.ops.kivi.paged_append.default,
                          (*layer.tensors(), paged.block_table, key, value, counts, *layer.params))
    layer.append(key, value, Step(counts=counts))
    query = _rand(g, 2, 4, 2, 32)
    torch.library.opcheck(torch.ops.kivi.paged_attend.default,
                          (query, *layer.tensors(), paged.block_table, torch.tensor([2, 1]), *layer.params, 0.25))


def test_swap_out_and_back_into_other_pages_gives_the_uninterrupted_outputs():
    """What a block manager does to preempt a sequence: copy its pages (page_tensors, by id) and
    its row (row_tensors) to host, let the pages and the row be reused (clobbered here), then
    bring them back into other page ids: decoding goes on bit for bit as if never interrupted."""
    B, H, HQ, D = 2, 2, 4, 32
    static, paged, manager = make_pair(CFG, B=B, H=H, D=D, page_size=8, max_pages=10, num_pages=30)
    g = torch.Generator().manual_seed(7)
    append_both(static, paged, manager, _rand(g, B, H, 41, D), _rand(g, B, H, 41, D), torch.tensor([41, 23]),
                prefill=True)
    layer = paged.layers[0]
    row, ids = 1, torch.tensor(manager.owned[1])
    saved_pages = {name: t[ids].clone() for name, t in layer.page_tensors().items()}
    saved_row = {name: t[row].clone() for name, t in layer.row_tensors().items()}
    for t in layer.page_tensors().values():  # the pages and the row are reused meanwhile
        t[ids] = torch.randint(0, 100, t[ids].shape).to(t.dtype)
    for t in layer.row_tensors().values():
        t[row] = torch.randint(0, 100, t[row].shape).to(t.dtype)
    manager.release(row)
    manager.free.reverse()  # different ids this time
    new_ids = torch.tensor([manager.free.pop() for _ in range(len(ids))])
    assert not torch.equal(new_ids, ids)
    manager.owned[row] = new_ids.tolist()
    paged.block_table[row, :len(new_ids)] = new_ids.to(torch.int32)
    for name, t in layer.page_tensors().items():
        t.index_copy_(0, new_ids, saved_pages[name])
    for name, t in layer.row_tensors().items():
        t[row] = saved_row[name]
    assert_same_state(static, paged)
    for step in range(20):
        append_both(static, paged, manager, _rand(g, B, H, 1, D), _rand(g, B, H, 1, D))
        q = _rand(g, B, HQ, 1, D)
        assert torch.equal(paged.layers[0].attend(q), static.layers[0].attend(q)), step


def test_restart_rows_and_reset():
    static, paged, manager = make_pair(CFG, B=2, H=2, D=32, page_size=16, max_pages=4)
    g = torch.Generator().manual_seed(8)
    append_both(static, paged, manager, _rand(g, 2, 2, 40, 32), _rand(g, 2, 2, 40, 32))
    fresh = torch.tensor([True, False])
    static.restart_rows(fresh)
    paged.restart_rows(fresh)
    manager.release(0)
    append_both(static, paged, manager, _rand(g, 2, 2, 18, 32), _rand(g, 2, 2, 18, 32), torch.tensor([18, 0]))
    assert_same_state(static, paged)
    table = paged.block_table.clone()
    paged.reset()
    assert int(paged.lengths().max()) == 0 and torch.equal(paged.block_table, table)


def test_pages_needed():
    # keys quantize R at a time: 127 tokens with R=32 hold 96 quantized, 3 pages of 32 (or 6 of 16)
    assert pages_needed(127, 32, 32) == 3 and pages_needed(127, 16, 32) == 6
    assert pages_needed(31, 16, 32) == 0 and pages_needed(32, 48, 32) == 1 and pages_needed(0, 8, 8) == 0
    with pytest.raises(ValueError, match="page_size"):
        pages_needed(10, 12, 32, group_size=8)
    with pytest.raises(ValueError, match="num_tokens"):
        pages_needed(-1, 8, 8)


def test_buffers_layout_and_bytes():
    paged = PagedKIVICache(CFG, num_layers=2, batch_size=3, num_pages=10, page_size=16, max_pages_per_seq=4,
                           num_kv_heads=2, head_dim=32, dtype=torch.float16)
    layer = paged.layers[0]
    assert layer.block_table is paged.block_table and paged.layers[1].block_table is paged.block_table
    assert paged.block_table.dtype == torch.int32 and paged.block_table.shape == (3, 4)
    assert all(t.shape[0] == 11 for t in layer.page_tensors().values())  # + the scratch page
    assert all(t.shape[0] == 3 for t in layer.row_tensors().values())
    assert set(layer.row_tensors()) == {"k_res", "v_res", "lengths"}
    # one page of 16 tokens, 2 heads, D=32, 2-bit: codes 16*8 bytes per head per side, key scale+zero
    # 2 groups x 32 x 2 x 2 bytes, value scale+zero 16 tokens x 4 groups x 2 x 2 bytes
    assert layer.page_nbytes() == 2 * (2 * 16 * 8 + 2 * 2 * 32 * 2 + 2 * 16 * 4 * 2)
    assert paged.page_nbytes() == 2 * layer.page_nbytes()
    assert paged.max_seq_len == 64


@pytest.mark.parametrize("field,value,flag", [("sink_tokens", 1, "sink"), ("outlier_tokens", 2, "outlier"),
                                              ("sparse_outliers", 0.05, "sparse")])
def test_refused_options_name_their_flag(field, value, flag):
    cfg = KIVIConfig(group_size=8, residual_length=16, **{field: value})
    with pytest.raises(ValueError, match=f"{field}.*--{flag}"):
        PagedKIVICache(cfg, num_layers=3, batch_size=1, num_pages=4, page_size=16, max_pages_per_seq=2,
                       num_kv_heads=1, head_dim=32)


@pytest.mark.parametrize("bad", [12, 0, -16, 8.0])
def test_page_size_must_be_a_multiple_of_the_group(bad):
    with pytest.raises(ValueError, match="page_size"):
        PagedKIVILayer(CFG, 0, batch_size=1, num_pages=4, page_size=bad, max_pages_per_seq=2, num_kv_heads=1,
                       head_dim=32)


def test_append_without_pages_is_refused_before_writing():
    paged = PagedKIVICache(CFG, num_layers=1, batch_size=2, num_pages=4, page_size=16, max_pages_per_seq=4,
                           num_kv_heads=1, head_dim=32)
    paged.block_table.fill_(-1)
    key = torch.randn(2, 1, 15, 32)
    paged.layers[0].append(key, key)  # 15 tokens: all in the residual, no page needed
    with pytest.raises(ValueError, match="block_table row 0 must give pages 0..0"):
        paged.layers[0].append(key[:, :, :1], key[:, :, :1])  # token 16 completes a key window
    assert paged.lengths().tolist() == [15, 15]
    paged.block_table[:, 0] = torch.tensor([0, 1], dtype=torch.int32)
    paged.layers[0].append(key[:, :, :1], key[:, :, :1])
    with pytest.raises(ValueError, match="block_table must be an int32"):
        PagedKIVILayer(CFG, 0, batch_size=2, num_pages=4, page_size=16, max_pages_per_seq=4, num_kv_heads=1,
                       head_dim=32, block_table=torch.zeros(2, 4, dtype=torch.int64))


def test_load_row_copies_a_prefilled_sequence_into_this_caches_pages():
    B, H, D = 2, 2, 32
    static, paged, manager = make_pair(CFG, B=B, H=H, D=D, page_size=8, max_pages=8)
    g = torch.Generator().manual_seed(9)
    k, v = _rand(g, 1, H, 37, D), _rand(g, 1, H, 37, D)
    one = PagedKIVICache(CFG, num_layers=1, batch_size=1, num_pages=9, page_size=8, max_pages_per_seq=8,
                         num_kv_heads=H, head_dim=D)
    ShuffledPages(one, seed=3).reserve([37])
    one.layers[0].append(k, v, Step(prefill=True))
    manager.reserve([0, 37])
    paged.load_row(1, one, 0)
    static.layers[0].append(torch.cat([k, k]), torch.cat([v, v]), Step(counts=torch.tensor([0, 37])))
    assert_same_state(static, paged)
    q = _rand(g, B, 4, 1, D)
    assert torch.equal(paged.layers[0].attend(q)[1], static.layers[0].attend(q)[1])
    assert math.isfinite(float(paged.layers[0].attend(q).abs().sum()))


def test_every_implementation_dispatch_can_choose_has_a_paged_form():
    """dispatch.choose is the same for paged layers; each implementation it names has a paged form
    in the one table (implementations.py), the same object on every call."""
    from kivi_ops.dispatch import implementations

    appends = {"reference", "decomposed", "decomposed_cond", "triton"}
    attends = {"reference", "decomposed_fused", "decomposed_materialized", "triton_decode", "triton_split",
               "cuda_cpp"}
    assert appends == set(implementations.APPEND) and attends == set(implementations.ATTEND)
    assert appends | attends == set(implementations.IMPLEMENTATIONS)
    for op, names in (("append", appends), ("attend", attends - {"cuda_cpp"})):  # cuda_cpp needs its extension
        for name in names:
            assert callable(implementations.form(op, name, True))
            assert implementations.form(op, name, True) is implementations.form(op, name, True)
            assert implementations.form(op, name, True) is not implementations.form(op, name, False)
    with pytest.raises(ValueError, match="no append implementation 'triton_split'"):
        implementations.form("append", "triton_split", True)
    with pytest.raises(ValueError, match="no attend implementation 'decomposed'"):
        implementations.form("attend", "decomposed", True)


def test_portable_paged_equals_portable_static():
    """A cache built for ONNX / ExecuTorch (portable: decomposed forms only, no kivi op) on pages."""
    run_equal(CFG, B=2, prompt=(20, 37), steps=10, portable=True)


def test_export_keeps_the_paged_ops_and_runs_them():
    """torch.export keeps kivi::paged_append / paged_attend in the program (their CPU kernel: the
    paged reference); the exported step gives the eager step's bits and writes the pages."""
    B, H, D = 2, 2, 32
    static, paged, manager = make_pair(CFG, B=B, H=H, D=D, page_size=16, max_pages=4)
    g = torch.Generator().manual_seed(10)
    append_both(static, paged, manager, _rand(g, B, H, 31, D), _rand(g, B, H, 31, D), torch.tensor([31, 12]),
                prefill=True)
    manager.reserve([1, 1])

    class DecodeStep(torch.nn.Module):
        def __init__(self, cache):
            super().__init__()
            self.cache = cache

        def forward(self, k, v, q):
            self.cache.layers[0].append(k, v)
            return self.cache.layers[0].attend(q)

    k, v, q = _rand(g, B, H, 1, D), _rand(g, B, H, 1, D), _rand(g, B, 4, 1, D)
    ep = torch.export.export(DecodeStep(paged), (k, v, q))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("kivi.paged_append" in t for t in targets) and any("kivi.paged_attend" in t for t in targets)
    got = ep.module()(k, v, q)
    want = DecodeStep(static)(k, v, q)
    assert torch.equal(got, want)
    assert_same_state(static, paged)  # token 32 completed a key window: written into row 0's page 1


def test_patched_model_generates_the_static_caches_tokens_on_pages():
    """A patched tiny Llama through kivi_models.generate (prefill, then decode steps; two layers
    sharing the block table): greedy tokens equal the static KIVICache's, with every row's pages
    handed out up front, shuffled."""
    import random

    from kivi_models import generate, make_cache, patch_model
    from tiny_models import tiny_llama

    model = patch_model(tiny_llama())
    prompts = [[5, 17, 9, 3, 42, 7, 30, 12, 8, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 25, 31]]
    static = make_cache(model, method="kivi", batch_size=2, max_seq_len=96, kivi_config=CFG)
    want = generate(model, prompts, max_new_tokens=40, cache=static).tokens
    c = model.config
    paged = PagedKIVICache(CFG, num_layers=c.num_hidden_layers, batch_size=2, num_pages=30, page_size=8,
                           max_pages_per_seq=12, num_kv_heads=c.num_key_value_heads,
                           head_dim=c.hidden_size // c.num_attention_heads)
    ids = list(range(24))
    random.Random(0).shuffle(ids)
    paged.block_table.copy_(torch.tensor(ids, dtype=torch.int32).view(2, 12))
    assert generate(model, prompts, max_new_tokens=40, cache=paged).tokens == want
