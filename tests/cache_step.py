"""A decode step over a prefilled KIVICache as a module, and the compile / export checks that the
option tests (test_pool.py, test_kvquant.py) share."""

import torch


class CacheStep(torch.nn.Module):
    """forward(key, value, query): append one token per row, then attend over layer 0."""

    def __init__(self, cache, impl, prefill_key, prefill_value, counts):
        super().__init__()
        self.cache = cache
        self.cache.append(0, prefill_key, prefill_value, counts)
        self.cache.use_impl(impl)

    def forward(self, key, value, query):
        self.cache.append(0, key, value)
        return self.cache.attend(0, query)


def step_inputs(n, *, B, H, HQ, D):
    gen = torch.Generator().manual_seed(9)
    return [(torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen),
             torch.randn(B, HQ, 1, D, generator=gen)) for _ in range(n)]


def check_compiled_matches_eager(make_step, impl, inputs, *, atol, rtol):
    """A fullgraph-compiled step (cache ops `impl`) gives the eager op's outputs and buffers."""
    eager, compiled_step = make_step("op"), make_step(impl)
    compiled = torch.compile(compiled_step, fullgraph=True)
    for k, v, q in inputs:
        torch.testing.assert_close(compiled(k, v, q), eager(k, v, q), atol=atol, rtol=rtol)
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled_step.named_buffers()):
        assert torch.equal(a, b), name


def check_export_matches_eager(make_step, impl, inputs, attend_op, *, atol, rtol):
    """torch.export of a step: "op" keeps the kivi attend op `attend_op`; "decomposed" holds no
    kivi op at all. The exported module gives the eager outputs."""
    eager = make_step("op")
    want = [eager(*x) for x in inputs]
    ep = torch.export.export(make_step(impl), inputs[0])
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any(attend_op in t for t in targets) == (impl == "op")
    if impl == "decomposed":
        assert not any("kivi" in t for t in targets)
    module = ep.module()
    for x, out in zip(inputs, want):
        torch.testing.assert_close(module(*x), out, atol=atol, rtol=rtol)
