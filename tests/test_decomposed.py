"""kivi_ops.kernels.decomposed.{append,attend}: static-shape cache append/attend vs the CPU reference;
export and compile."""

import random

import pytest
import torch

from kivi_ops import KIVICache, KIVIConfig
from kivi_ops.kernels.decomposed.append import append_decomposed
from kivi_ops.kernels.decomposed.attend import attend_fused, attend_materialized
from kivi_ops.kernels.reference import append_reference, attend_reference
from kivi_ops.layout import LayerTensors, QuantParams

NAMES = ("k_codes", "k_scale", "k_zero", "k_res", "v_codes", "v_scale", "v_zero", "v_res", "lengths")

# Attention tolerance. Both sides compute in fp32 from the same buffers; they differ only in the
# order of the sums: scores sum D <= 64 products (in another grouping: scale and zero folded
# differently, the reference in blocks of 1024 tokens with an online softmax), so a score differs
# by a few ulps of sum_d |q_d k_d| (here |scores| < ~20 -> ~1e-5 at the very worst, ~1e-6 in
# practice). exp turns an absolute score error e into a relative weight error e, and the output is
# a convex combination of values |v| < ~5, normalized by sums of up to S weights (relative error
# ~S * eps). Observed differences are < 2e-6; 1e-5 leaves room without hiding a real bug (a wrong
# token, scale or mask moves the output by ~1e-1).
ATOL = RTOL = 1e-5

CONFIGS = [
    # (k_bits, v_bits, G, R, S): S a multiple of nothing (77), S < R (40, 12), decode crossing flushes
    (2, 2, 8, 16, 100),
    (4, 2, 8, 32, 77),
    (8, 4, 16, 16, 50),
    (2, 8, 32, 64, 40),
    (4, 4, 4, 8, 37),
    (2, 4, 8, 16, 12),
    # 3-bit codes (8 per 3 bytes): alone, and beside other widths
    (3, 3, 8, 16, 100),
    (4, 3, 8, 32, 77),
    (3, 8, 16, 16, 40),
]
ATTEND_CONFIGS = CONFIGS[:4] + CONFIGS[6:]


def scenario():
    """(n, mode) appends: a ragged prefill with an empty row, decode steps across several key
    flushes, a chunk, ragged decode steps, then one append that fills the cache."""
    return ([(23, "ragged"), (1, "all"), (1, "ragged"), (5, "ragged")] + [(1, "all")] * 21 + [(17, "ragged")]
            + [(1, "ragged")] * 10 + [(10**6, "fill")])


def run_pair(cfg, S, seed, B=3, H=2, D=32, flush_under_cond=False):
    """Apply the same appends to two caches, one with the reference and one decomposed; yield
    after each step (ref LayerTensors, decomposed LayerTensors, counts, n, generator)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    caches = [KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
              for _ in range(2)]
    ref, dec = (c.layers[0].tensors() for c in caches)
    params = caches[0].layers[0].params
    for step, (n, mode) in enumerate(scenario()):
        room = (S - ref.lengths).tolist()
        n = min(n, max(room))
        if n == 0:
            break
        if mode == "fill":
            counts = torch.tensor(room)
        elif mode == "ragged" or min(room) < n:
            counts = [rnd.randint(0, min(n, r)) for r in room]
            if step == 0:
                counts[0], counts[-1] = 0, n  # an empty row and a full one
            counts = torch.tensor(counts)
        else:
            counts = None
        key, value = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
        append_reference(ref, key, value, counts, params)
        with torch.no_grad():  # the branch is taken with grad off only (kernels/decomposed/append.py)
            append_decomposed(dec, key, value, counts, params, flush_under_cond=flush_under_cond)
        yield ref, dec, counts, n, gen


@pytest.mark.parametrize("flush_under_cond", [False, True], ids=["always", "cond"])
@pytest.mark.parametrize("cfg_s", CONFIGS, ids=lambda c: "k{}v{}G{}R{}S{}".format(*c))
def test_append_matches_reference_bitwise(cfg_s, flush_under_cond):
    # "cond": the key flush under torch.cond, as compiled CPU steps run it (run eagerly here).
    k_bits, v_bits, G, R, S = cfg_s
    cfg = KIVIConfig(k_bits, v_bits, G, R)
    for ref, dec, counts, n, _ in run_pair(cfg, S, seed=S, flush_under_cond=flush_under_cond):
        for name, a, b in zip(NAMES, ref.kivi, dec.kivi):
            assert torch.equal(a, b), f"{name} differs after appending n={n}, counts={counts}"
    assert (ref.lengths == S).all()  # ran to capacity


@pytest.mark.parametrize("S", [12, 40])
def test_append_of_more_padded_tokens_than_capacity(S):
    # n > S is fine as long as the real tokens fit: the static windows are capped by S.
    cfg = KIVIConfig(2, 4, 8, 16)
    caches = [KIVICache(cfg, num_layers=1, batch_size=2, max_seq_len=S, num_kv_heads=2, head_dim=32) for _ in range(2)]
    for n, counts in ((50, [S - 3, 5]), (50, [3, S - 5])):
        key, value = torch.randn(2, 2, n, 32), torch.randn(2, 2, n, 32)
        params = caches[0].layers[0].params
        assert params[:4] == (2, 4, 8, 16)
        append_reference(caches[0].layers[0].tensors(), key, value, torch.tensor(counts), params)
        append_decomposed(caches[1].layers[0].tensors(), key, value, torch.tensor(counts), params)
        for name, a, b in zip(NAMES, caches[0].layers[0].tensors().kivi, caches[1].layers[0].tensors().kivi):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("cfg_s", ATTEND_CONFIGS, ids=lambda c: "k{}v{}G{}R{}S{}".format(*c))
def test_attend_matches_reference(cfg_s):
    k_bits, v_bits, G, R, S = cfg_s
    cfg = KIVIConfig(k_bits, v_bits, G, R)
    params = QuantParams(k_bits, v_bits, G, R)
    for ref, dec, counts, n, gen in run_pair(cfg, S, seed=S + 1):
        B, H = ref.k_codes.shape[:2]
        query = torch.randn(B, 3 * H, n, ref.k_res.shape[-1], generator=gen)  # GQA, 3 query heads per kv head
        want = attend_reference(query, ref, counts, params, 0.3)
        for form, attend in (("fused", attend_fused), ("materialized", attend_materialized)):
            got = attend(query, dec, counts, params, 0.3)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{form}, n={n}: {m}")
            if counts is not None:  # padding query rows are exactly zero
                pad = torch.arange(n)[None, :] >= counts[:, None]
                assert (got.transpose(1, 2)[pad] == 0).all()


# ---------------------------------------------------------------- export / compile

EXPORT_CFG = KIVIConfig(k_bits=4, v_bits=2, group_size=8, residual_length=16)


class DecodeStep(torch.nn.Module):
    """One decode step over module buffers: decomposed append, then the fused decomposed attention
    (the decode form)."""

    def __init__(self, B=2, H=2, S=48, D=32, flush_under_cond=False):
        super().__init__()
        self.cache = KIVICache(EXPORT_CFG, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
        self.flush_under_cond = flush_under_cond

    def forward(self, key, value, query):
        layer, params = self.cache.layers[0].tensors(), self.cache.layers[0].params
        append_decomposed(layer, key, value, None, params, flush_under_cond=self.flush_under_cond)
        return attend_fused(query, layer, None, params, 0.25)


def prefilled_step(seed=0, flush_under_cond=False):
    torch.manual_seed(seed)
    step = DecodeStep(flush_under_cond=flush_under_cond)
    k, v = torch.randn(2, 2, 13, 32), torch.randn(2, 2, 13, 32)
    append_reference(step.cache.layers[0].tensors(), k, v, torch.tensor([13, 6]), step.cache.layers[0].params)
    return step


def decode_inputs(n_steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 2, 1, 32, generator=gen), torch.randn(2, 2, 1, 32, generator=gen),
             torch.randn(2, 4, 1, 32, generator=gen)) for _ in range(n_steps)]


def test_export_has_only_aten_ops_static_shapes_and_matches_eager():
    inputs = decode_inputs(6)  # 13 + 6 tokens: the first row crosses a key flush at 16
    eager = prefilled_step()
    want = [eager(k, v, q) for k, v, q in inputs]
    # Each program shares its buffers with the module it was exported from: one module each.
    ep = torch.export.export(prefilled_step(), inputs[0])
    for node in ep.graph.nodes:
        if node.op == "call_function":
            assert "kivi" not in str(node.target)
            if isinstance(node.target, torch._ops.OpOverload):
                assert node.target.namespace == "aten", f"non-aten op in the exported graph: {node.target}"
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(v, torch.Tensor):
                assert all(isinstance(d, int) for d in v.shape), f"symbolic shape at {node}: {v.shape}"
    assert not ep.range_constraints
    # The default export IR keeps the in-place buffer updates; the core ATen program (what
    # ExecuTorch / ONNX consume) is functional, with the nine cache buffers as mutated state.
    core = torch.export.export(prefilled_step(), inputs[0]).run_decompositions()
    assert set(core.graph_signature.buffers_to_mutate.values()) == {
        f"cache.{name}" for name, _ in eager.cache.named_buffers()}
    assert len(core.graph_signature.buffers_to_mutate) == len(NAMES)
    for program in (ep, core):
        module = program.module()
        for (k, v, q), out in zip(inputs, want):
            assert torch.equal(module(k, v, q), out)
        state = dict(module.named_buffers())
        for name, buf in eager.cache.named_buffers():
            assert torch.equal(state[f"cache.{name}"], buf), name


# Compiled alone in `make test-slow` (a cold Inductor build each); `make test` compiles these forms in
# a model (test_model.py) and exports the flush without a cond through torch.export above.
@pytest.mark.slow
@pytest.mark.parametrize("flush_under_cond", [False, True], ids=["always", "cond"])
@torch.no_grad()
def test_compile_fullgraph_matches_reference(flush_under_cond):
    step = prefilled_step(flush_under_cond=flush_under_cond)
    params = step.cache.layers[0].params
    ref = LayerTensors(*(None if t is None else t.clone() for t in step.cache.layers[0].tensors()))
    graphs = []

    def inductor_recording(gm, example_inputs):
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    compiled = torch.compile(step, fullgraph=True, backend=inductor_recording)
    for k, v, q in decode_inputs(8):  # crosses the first row's key flush at 16 tokens
        got = compiled(k, v, q)
        append_reference(ref, k, v, None, params)
        want = attend_reference(q, ref, None, params, 0.25)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        for name, a, b in zip(NAMES, ref.kivi, step.cache.layers[0].tensors().kivi):
            assert torch.equal(a, b), name
    conds = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(graphs) == 1 and len(conds) == int(flush_under_cond)  # the key flush is branched, once
