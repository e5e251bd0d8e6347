"""A decode step over a KIVICache holding a prompt, as a module, and the compile / export checks that the
option tests (test_pool.py, test_kvquant.py) share.

Which implementation a step runs is kivi_ops/dispatch/__init__.py's choice: eager on CPU and torch.export
call the kivi ops (CPU kernel: the reference); torch.compile on CPU traces the decomposed forms
inline; a `portable` cache runs the decomposed append and materialized attention everywhere (no
kivi op). `through_op=True` calls torch.ops.kivi.* directly instead of the cache's methods, which
keeps the kivi op in a compiled graph (what CUDA runs). `make_step(portable=...)` builds the cache
with that flag (fixed at construction)."""

import math

import torch

from kivi_ops import Step


class CacheStep(torch.nn.Module):
    """forward(key, value, query): append one token per row, then attend over layer 0."""

    def __init__(self, cache, prefill_key, prefill_value, counts, *, through_op=False):
        super().__init__()
        self.cache = cache
        self.cache.layers[0].append(prefill_key, prefill_value, Step(counts=counts))
        self.through_op = through_op

    def forward(self, key, value, query):
        cache = self.cache
        if not self.through_op:
            cache.layers[0].append(key, value)
            return cache.layers[0].attend(query)
        params = cache.layers[0].params
        torch.ops.kivi.cache_append(*cache.layers[0].tensors(), key, value, None, *params)
        scale = 1.0 / math.sqrt(cache.head_dim) * cache.layers[0].rope_scaling
        return torch.ops.kivi.cache_attend(query, *cache.layers[0].tensors(), None, *params, scale)


def step_inputs(n, *, B, H, HQ, D):
    gen = torch.Generator().manual_seed(9)
    return [(torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen),
             torch.randn(B, HQ, 1, D, generator=gen)) for _ in range(n)]


def check_compiled_matches_eager(make_step, inputs, *, through_op=False, atol, rtol):
    """A fullgraph-compiled step gives the eager step's (the kivi ops') outputs and buffers.
    Compiled on CPU, the cache traces the decomposed forms (no kivi op in the graph);
    through_op=True compiles a step that calls the kivi ops themselves."""
    from torch._inductor.compile_fx import compile_fx

    targets = set()

    def backend(gm, example_inputs):  # Inductor, after noting what Dynamo traced
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    eager, compiled_step = make_step(), make_step(through_op=through_op)
    compiled = torch.compile(compiled_step, fullgraph=True, backend=backend)
    for k, v, q in inputs:
        torch.testing.assert_close(compiled(k, v, q), eager(k, v, q), atol=atol, rtol=rtol)
    assert targets
    assert any("kivi.cache_append" in t for t in targets) == through_op
    assert any("kivi.cache_attend" in t for t in targets) == through_op
    if not through_op:
        assert not any("kivi" in t for t in targets), sorted(targets)
    for (name, a), (name_b, b) in zip(eager.named_buffers(), compiled_step.named_buffers(), strict=True):
        assert name == name_b
        assert torch.equal(a, b), name


def check_export_matches_eager(make_step, portable, inputs, *, atol, rtol):
    """torch.export of a step: a cache that is not portable keeps the kivi ops (cache_attend and
    cache_append) in the program; a portable one holds no kivi op at all. The exported module
    gives the eager outputs."""
    eager = make_step()
    want = [eager(*x) for x in inputs]
    ep = torch.export.export(make_step(portable=portable), inputs[0])
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("kivi.cache_attend" in t for t in targets) == (not portable)
    assert any("kivi.cache_append" in t for t in targets) == (not portable)
    if portable:
        assert not any("kivi" in t for t in targets)
    module = ep.module()
    for x, out in zip(inputs, want):
        torch.testing.assert_close(module(*x), out, atol=atol, rtol=rtol)
