"""How the Triton cache kernels take their arguments: flat at the launch, grouped inside.

torch.compile / torch.export trace a launch through torch.library.wrap_triton, and their tracer
only sees top-level tensor and scalar arguments: a tuple of tensors would be stored as a constant
and its writes missed. So every launched kernel keeps a flat argument list, and its first act is
to group that list into the named tuples below and hand them to one @triton.jit body. Between
jit functions the tuples are free (Triton flattens them again): same IR, same code. Pass a
group as a call argument and read its constexprs as fields (lay.D); assigning a group to a local
(x = Layout(...), or unpacking it) turns its constexprs into tensors.

Each option is one tuple with its constexpr flag inside. An option that is off gets dummy
pointers (a buffer of the layer the kernel never reads) and its flag False, so the kernel
compiles exactly as without the option. option_args builds those arguments, for the attention
and the append launchers alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...options.extras import Extras, key_outliers_per_window
from ...layout import LayerTensors, QuantParams
from ..reference.packing import codes_per_word
from .quant import next_pow2


# ---------------------------------------------------------------- the groups, inside the kernels


class KiviCache(NamedTuple):
    """The eight KIVI buffers of one layer: key codes / per-channel scale and zero / residual ring,
    value codes / per-token scale and zero / residual ring."""
    k_codes: object
    k_scale: object
    k_zero: object
    k_res: object
    v_codes: object
    v_scale: object
    v_zero: object
    v_res: object


class CacheSide(NamedTuple):
    """One side (keys or values) of the KIVI cache: codes, scale, zero, residual ring."""
    codes: object
    scale: object
    zero: object
    res: object


class Levels(NamedTuple):
    """KVQuant's nuq levels: codes index these tables when HAS_LEVELS (None for the side a
    kernel does not touch)."""
    k_levels: object
    v_levels: object
    HAS_LEVELS: object


class Rope(NamedTuple):
    """Pre-RoPE keys (ROPE): the model's inv_freq [D / 2]."""
    inv_freq: object
    ROPE: object


class Sparse(NamedTuple):
    """The dense-and-sparse outlier store (SPARSE): NK exact key entries per channel and R-token
    window (NKR rows per (b, h)), NV exact value entries per token (None for the side a kernel
    does not touch)."""
    k_sparse: object
    k_sparse_idx: object
    v_sparse: object
    v_sparse_idx: object
    NKR: object
    NK: object
    NV: object
    SPARSE: object


class Pool(NamedTuple):
    """The full-precision token pool as attention reads it (HAS_POOL): P slots per (b, h), P_P
    its power-of-two padding."""
    pool_k: object
    pool_v: object
    pool_pos: object
    P: object
    HAS_POOL: object
    P_P: object


class OttPool(NamedTuple):
    """The sink/OTT pool as the append writes it: SINK sink slots, then N_OUT outlier slots (N_P
    padded) and the spill slots (SP_P padded); scratch keeps the old outlier rows during a step."""
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
    """The appended keys or values [B, H, n, D] with their strides (s_n is 0 for one token)."""
    ptr: object
    s_b: object
    s_h: object
    s_n: object
    s_d: object


class KeyLayout(NamedTuple):
    """A key flush's compile-time shape: head_dim D (D_P padded, DC channels per chunk of the OTT
    scores), NB words of BITS-bit codes (PER per word; NB * PER * BITS / 8 bytes, packing.py) per
    token in blocks of BLOCK_B, groups of
    G tokens, the residual ring of R tokens (R_P padded, RR rows stored)."""
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
    """A value flush's compile-time shape: head_dim D (D_P padded), NB words of BITS-bit codes
    (PER per word) per token, NG groups of GV channels (GB_P words padded), the residual ring of
    R tokens (RR rows stored)."""
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


# ---------------------------------------------------------------- the flat arguments, at the launch


def option_args(t: LayerTensors, p: QuantParams, extras: Extras, *, writes: bool = False) -> dict:
    """The launch arguments of every cache option, by kernel parameter name (a launcher passes
    those its kernel takes: kernel_options). extras: the checked, contiguous extras
    (check_kernel_extras). Options that are off get dummy pointers and their flag False. writes:
    for the append, which writes the sparse store in place (so the layer's own buffers must be
    contiguous; attention reads contiguous copies) and needs the OTT step's scratch."""
    dummy = t.k_scale
    has_levels, rope, sparse = extras.k_levels is not None, extras.rope_inv_freq is not None, extras.sparse
    args = dict(
        k_levels=extras.k_levels if has_levels else dummy, v_levels=extras.v_levels if has_levels else dummy,
        HAS_LEVELS=has_levels,
        rope_inv_freq=extras.rope_inv_freq if rope else dummy, ROPE=rope,
        k_sparse=dummy, k_sparse_idx=dummy, v_sparse=dummy, v_sparse_idx=dummy, NKR=0, NK=0, NV=0, SPARSE=sparse,
    )
    if rope:  # pre-RoPE keys are dequantized in halves of D/2 channels: each half whole bytes of codes
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
    # Shapes and dtypes: the op's check_layer (ops.check_pool). Attention reads the pool in place too.
    for name, x in zip(("pool_k", "pool_v", "pool_pos"), pool):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a whole registered buffer)")
    pool_k, pool_v, pool_pos = pool
    B, H, _, D = t.k_res.shape
    P, sink, n_out = pool_pos.shape[-1], p.sink_tokens, p.outlier_tokens
    # The append's OTT step keeps the old outlier rows here while it rewrites their slots.
    scratch = pool_k.new_empty((B * H, n_out, 2, D)) if n_out and writes else pool_k
    args.update(pool_k=pool_k, pool_v=pool_v, pool_pos=pool_pos, scratch=scratch, P=P, HAS_POOL=True,
                P_P=next_pow2(P), SINK=sink, N_OUT=n_out, N_P=next_pow2(max(n_out, 1)),
                SP_P=next_pow2(max(P - sink - n_out, 1)))
    return args


def kernel_options(kernel, options: dict) -> dict:
    """The entries of option_args that `kernel` takes (by parameter name)."""
    return {name: value for name, value in options.items() if name in kernel.arg_names}
