"""torch.compile with Dynamo's recompile budget per specialization, not per function.

Dynamo keeps the versions it compiles of a function on the function's code object, at most
`torch._dynamo.config.recompile_limit` (8 in torch 2.13), and under fullgraph=True the compile
past that fails (FailOnRecompileLimitHit) instead of running eagerly. We met it twice:
- torch.compile wraps every functools.partial in one shared function (external_utils.wrap_inline's
  `inner`), so all our partial kernel forms shared one budget (CI's make test-slow);
- one decode step compiled for ever more shapes: `model.generate()` with our cache at a 9th batch
  size in one process failed (measured).
So each specialization we can name (shapes, dtypes, plain settings: `signature`) gets a function
with a code object of its own (`compile_own_code`), which holds only that specialization's few
versions (e.g. with and without counts).
"""

from __future__ import annotations

import torch

from ..kernels.decomposed.avx2_byte_loads import install as install_avx2_byte_loads


def signature(*args) -> tuple:
    """What compiled code is specialized to, as a hashable key: tensor shapes, strides, dtypes,
    devices and dispatch keys (an inference tensor has no autograd keys), tuples element by element,
    other values as themselves; and the grad mode."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return tuple(a.shape), a.stride(), a.dtype, a.device, a.is_inference(), a.requires_grad
        if isinstance(a, tuple):
            return tuple(one(x) for x in a)
        return a
    return one(args) + (torch.is_grad_enabled(),)


def compile_own_code(fn, **options):
    """torch.compile(fn, **options) through a function whose code object is its own, so that
    Dynamo's recompile budget (see the module doc) is this compile's alone."""
    def run(*args, **kwargs):
        return fn(*args, **kwargs)

    run.__code__ = run.__code__.replace()  # a new code object: replace() always builds one
    install_avx2_byte_loads()  # AVX2: the packed codes' loads without a store-forwarding stall
    return torch.compile(run, **options)
