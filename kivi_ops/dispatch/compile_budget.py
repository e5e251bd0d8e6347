"""torch.compile with Dynamo's recompile budget per specialization: Dynamo keeps at most
recompile_limit versions per code object and fullgraph then fails, and torch.compile wraps every
functools.partial in one shared function, so each `signature` gets a code object of its own."""

from __future__ import annotations

import torch

from ..kernels.decomposed.avx2_byte_loads import install as install_avx2_byte_loads


def signature(*args) -> tuple:
    """What compiled code specializes on: tensor shapes, strides, dtypes, devices, inference mode,
    requires_grad; tuples element-wise; the grad mode."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return tuple(a.shape), a.stride(), a.dtype, a.device, a.is_inference(), a.requires_grad
        if isinstance(a, tuple):
            return tuple(one(x) for x in a)
        return a
    return one(args) + (torch.is_grad_enabled(),)


def compile_own_code(fn, **options):
    """torch.compile(fn) through a function with its own code object, so its recompile budget is its own."""
    def run(*args, **kwargs):
        return fn(*args, **kwargs)

    run.__code__ = run.__code__.replace()  # replace() always builds a new code object
    install_avx2_byte_loads()  # AVX2: the packed codes' loads without a store-forwarding stall
    return torch.compile(run, **options)
