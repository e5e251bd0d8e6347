"""Triton cache kernels' arguments: flat at the launch (wrap_triton's tracer sees only top-level
tensors; a tuple would be stored as a constant and its writes missed), grouped in the named tuples
below inside. Pass a group as a call argument: assigning it to a local turns its constexprs into
tensors. An option that is off gets dummy pointers and its flag False (the plain kernel's code)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...options.extras import Extras, key_outliers_per_window
from ...layout import LayerTensors, QuantParams
from ..reference.packing import codes_per_word
from .quant import next_pow2


class KiviCache(NamedTuple):
    k_codes: object
    k_scale: object
    k_zero: object
    k_res: object
    v_codes: object
    v_scale: object
    v_zero: object
    v_res: object


class CacheSide(NamedTuple):
    codes: object
    scale: object
    zero: object
    res: object


class Levels(NamedTuple):
    k_levels: object
    v_levels: object
    HAS_LEVELS: object


class Rope(NamedTuple):
    inv_freq: object
    ROPE: object


class Sparse(NamedTuple):
    k_sparse: object
    k_sparse_idx: object
    v_sparse: object
    v_sparse_idx: object
    NKR: object
    NK: object
    NV: object
    SPARSE: object


class Pool(NamedTuple):
    pool_k: object
    pool_v: object
    pool_pos: object
    P: object
    HAS_POOL: object
    P_P: object


class OttPool(NamedTuple):
    """The pool as the append writes it; scratch keeps the old outlier rows during a step."""
    pool_k: object
    pool_v: object
    pool_pos: object
    scratch: object
    P: object
    SINK: object
    N_OUT: object
    N_P: object
    SP_P: object


class NewRows(NamedTuple):
    ptr: object
    s_b: object
    s_h: object
    s_n: object
    s_d: object


class KeyLayout(NamedTuple):
    D: object
    D_P: object
    DC: object
    NB: object
    BITS: object
    PER: object
    BLOCK_B: object
    G: object
    R: object
    R_P: object
    RR: object


class ValueLayout(NamedTuple):
    D: object
    D_P: object
    NB: object
    NG: object
    BITS: object
    PER: object
    GV: object
    GB_P: object
    R: object
    RR: object


def option_args(t: LayerTensors, p: QuantParams, extras: Extras, *, writes: bool = False) -> dict:
    """Launch arguments of every cache option by kernel parameter name; writes: for the append."""
    dummy = t.k_scale
    has_levels, rope, sparse = extras.k_levels is not None, extras.rope_inv_freq is not None, extras.sparse
    args = dict(
        k_levels=extras.k_levels if has_levels else dummy, v_levels=extras.v_levels if has_levels else dummy,
        HAS_LEVELS=has_levels,
        rope_inv_freq=extras.rope_inv_freq if rope else dummy, ROPE=rope,
        k_sparse=dummy, k_sparse_idx=dummy, v_sparse=dummy, v_sparse_idx=dummy, NKR=0, NK=0, NV=0, SPARSE=sparse,
    )
    if rope:
        D = t.k_res.shape[-1]
        if D % 2 or (D // 2) % codes_per_word(p.k_bits):
            raise ValueError(f"pre-RoPE keys need head_dim / 2 = {D / 2} to be a multiple of "
                             f"{codes_per_word(p.k_bits)} ({p.k_bits}-bit codes per packed word)")
    if sparse:
        if writes:
            for name in ("k_sparse", "k_sparse_idx", "v_sparse", "v_sparse_idx"):
                if not getattr(t, name).is_contiguous():
                    raise ValueError(f"{name} must be contiguous: the append writes it in place")
        args.update(k_sparse=extras.k_sparse, k_sparse_idx=extras.k_sparse_idx, v_sparse=extras.v_sparse,
                    v_sparse_idx=extras.v_sparse_idx, NKR=extras.k_sparse.shape[2],
                    NK=key_outliers_per_window(extras.k_sparse, t.k_codes.shape[2], p.residual_length),
                    NV=extras.v_sparse.shape[-1])
    pool = t.pool
    if pool is None:
        args.update(pool_k=dummy, pool_v=dummy, pool_pos=t.lengths, scratch=dummy, P=0, HAS_POOL=False, P_P=1,
                    SINK=0, N_OUT=0, N_P=1, SP_P=1)
        return args
    for name, x in zip(("pool_k", "pool_v", "pool_pos"), pool):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a whole registered buffer)")
    pool_k, pool_v, pool_pos = pool
    B, H, _, D = t.k_res.shape
    P, sink, n_out = pool_pos.shape[-1], p.sink_tokens, p.outlier_tokens
    scratch = pool_k.new_empty((B * H, n_out, 2, D)) if n_out and writes else pool_k
    args.update(pool_k=pool_k, pool_v=pool_v, pool_pos=pool_pos, scratch=scratch, P=P, HAS_POOL=True,
                P_P=next_pow2(P), SINK=sink, N_OUT=n_out, N_P=next_pow2(max(n_out, 1)),
                SP_P=next_pow2(max(P - sink - n_out, 1)))
    return args


def kernel_options(kernel, options: dict) -> dict:
    return {name: value for name, value in options.items() if name in kernel.arg_names}
