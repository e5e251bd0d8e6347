"""The `torch.ops.kivi` custom ops: schema, fake kernel, CPU reference, CUDA (Triton) kernel.

    kivi::quantize_pack(x, bits, group_size, axis) -> (codes, scale, zero)
    kivi::unpack_dequantize(codes, scale, zero, bits, group_size, axis) -> x'
    kivi::cache_append(<9 cache buffers, mutated>, key, value, counts?, k_bits, v_bits, group_size, residual_length)
    kivi::cache_attend(query, <9 cache buffers>, counts?, k_bits, v_bits, group_size, residual_length, scale) -> out

The ops are opaque to torch.compile/export (`custom_op`, not `triton_op`): the CPU reference
uses per-sequence Python control flow that Inductor could not trace, and keeping the op whole
keeps it visible in exported graphs. The CUDA kernels launch Triton directly (graph-capture safe:
no host syncs). Cache buffers are always passed whole, never sliced, so functionalization can
re-inplace the mutation instead of cloning the cache.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .cache_reference import cache_append_reference, cache_attend_reference
from .config import check_axis, check_bits, check_group_size
from .extras import SPARSE_BUFFERS, checked_extras
from .packing import FLOAT_DTYPES, codes_per_byte, quantize_pack_reference, token_group_size, unpack_dequantize_reference

CACHE_BUFFERS = ("k_codes", "k_scale", "k_zero", "k_res", "v_codes", "v_scale", "v_zero", "v_res", "lengths")


def check_quantize_args(x: Tensor, bits: int, group_size: int, axis: str) -> None:
    check_bits("bits", bits)
    check_group_size("group_size", group_size)
    check_axis(axis)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., T, D] (at least 2 dims), got {tuple(x.shape)}")
    T, D = x.shape[-2], x.shape[-1]
    if D % codes_per_byte(bits):
        raise ValueError(f"x's last dim D={D} must be a multiple of {codes_per_byte(bits)} to pack {bits}-bit codes")
    if axis == "channel" and T % group_size:
        raise ValueError(
            f"axis='channel' groups {group_size} consecutive tokens: x's token dim T={T} must be a "
            f"multiple of group_size={group_size} (pad or keep the remainder in full precision)"
        )
    if axis == "token" and D % token_group_size(group_size, D):
        raise ValueError(f"axis='token' needs head dim D={D} to be a multiple of group_size={group_size}")


def _group_shape(shape, group_size: int, axis: str):
    *lead, T, D = shape
    if axis == "channel":
        return (*lead, T // group_size, D)
    return (*lead, T, D // token_group_size(group_size, D))


# ---------------------------------------------------------------- quantize / dequantize


@torch.library.custom_op("kivi::quantize_pack", mutates_args=())
def quantize_pack(x: Tensor, bits: int, group_size: int, axis: str) -> tuple[Tensor, Tensor, Tensor]:
    check_quantize_args(x, bits, group_size, axis)
    return quantize_pack_reference(x.contiguous(), bits, group_size, axis)


@quantize_pack.register_fake
def _(x, bits, group_size, axis):
    check_quantize_args(x, bits, group_size, axis)
    *lead, T, D = x.shape
    codes = x.new_empty((*lead, T, D // codes_per_byte(bits)), dtype=torch.uint8)
    gshape = _group_shape(x.shape, group_size, axis)
    return codes, x.new_empty(gshape), x.new_empty(gshape)


@quantize_pack.register_kernel("cuda")
def _(x, bits, group_size, axis):
    from .triton_quant import quantize_pack_triton

    check_quantize_args(x, bits, group_size, axis)
    return quantize_pack_triton(x.contiguous(), bits, group_size, axis)


def check_dequantize_args(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, axis: str) -> None:
    check_bits("bits", bits)
    check_group_size("group_size", group_size)
    check_axis(axis)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 (packed), got {codes.dtype}")
    if scale.dtype not in FLOAT_DTYPES or zero.dtype != scale.dtype:
        raise ValueError(f"scale and zero must share a float dtype, got {scale.dtype} and {zero.dtype}")
    D = codes.shape[-1] * codes_per_byte(bits)
    expected = _group_shape((*codes.shape[:-1], D), group_size, axis)
    if tuple(scale.shape) != expected or tuple(zero.shape) != expected:
        raise ValueError(
            f"scale/zero must have shape {expected} for codes {tuple(codes.shape)} at {bits} bits, "
            f"group_size={group_size}, axis={axis!r}; got {tuple(scale.shape)} and {tuple(zero.shape)}"
        )


@torch.library.custom_op("kivi::unpack_dequantize", mutates_args=())
def unpack_dequantize(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, axis: str) -> Tensor:
    check_dequantize_args(codes, scale, zero, bits, group_size, axis)
    return unpack_dequantize_reference(codes, scale, zero, bits, group_size, axis)


@unpack_dequantize.register_fake
def _(codes, scale, zero, bits, group_size, axis):
    check_dequantize_args(codes, scale, zero, bits, group_size, axis)
    return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * codes_per_byte(bits)), dtype=scale.dtype)


@unpack_dequantize.register_kernel("cuda")
def _(codes, scale, zero, bits, group_size, axis):
    from .triton_quant import unpack_dequantize_triton

    check_dequantize_args(codes, scale, zero, bits, group_size, axis)
    return unpack_dequantize_triton(codes.contiguous(), scale.contiguous(), zero.contiguous(), bits, group_size, axis)


# ---------------------------------------------------------------- cache append / attend


@torch.library.custom_op("kivi::cache_append", mutates_args=CACHE_BUFFERS + SPARSE_BUFFERS)
def cache_append(
    k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, k_res: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, v_res: Tensor, lengths: Tensor,
    key: Tensor, value: Tensor, counts: Optional[Tensor],
    k_bits: int, v_bits: int, group_size: int, residual_length: int,
    k_levels: Optional[Tensor] = None, v_levels: Optional[Tensor] = None,
    k_sparse: Optional[Tensor] = None, k_sparse_idx: Optional[Tensor] = None,
    v_sparse: Optional[Tensor] = None, v_sparse_idx: Optional[Tensor] = None,
) -> None:
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx)
    cache_append_reference(
        k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
        key, value, counts, k_bits, v_bits, group_size, residual_length, extras=extras,
    )


@cache_append.register_fake
def _(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
      key, value, counts, k_bits, v_bits, group_size, residual_length,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None):
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx)
    return None


@cache_append.register_kernel("cuda")
def _(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
      key, value, counts, k_bits, v_bits, group_size, residual_length,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None):
    from .triton_cache import cache_append_triton

    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx)
    if extras.sparse:  # dense-and-sparse outliers: no Triton kernel, the decomposed (graph-safe) form
        from .decomposed import cache_append_decomposed

        cache_append_decomposed(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
                                key.to(k_res.dtype), value.to(v_res.dtype), counts, k_bits, v_bits, group_size,
                                residual_length, extras=extras)
        return
    cache_append_triton(
        k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
        key, value, counts, k_bits, v_bits, group_size, residual_length, extras=extras,
    )


@torch.library.custom_op("kivi::cache_attend", mutates_args=())
def cache_attend(
    query: Tensor,
    k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, k_res: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, v_res: Tensor, lengths: Tensor,
    counts: Optional[Tensor],
    k_bits: int, v_bits: int, group_size: int, residual_length: int, scale: float,
    k_levels: Optional[Tensor] = None, v_levels: Optional[Tensor] = None,
    k_sparse: Optional[Tensor] = None, k_sparse_idx: Optional[Tensor] = None,
    v_sparse: Optional[Tensor] = None, v_sparse_idx: Optional[Tensor] = None,
    rope_inv_freq: Optional[Tensor] = None,
) -> Tensor:
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, rope_inv_freq)
    return cache_attend_reference(
        query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
        counts, k_bits, v_bits, group_size, residual_length, scale, extras=extras,
    )


@cache_attend.register_fake
def _(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
      counts, k_bits, v_bits, group_size, residual_length, scale,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None,
      rope_inv_freq=None):
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, rope_inv_freq)
    return torch.empty_like(query)


@cache_attend.register_kernel("cuda")
def _(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
      counts, k_bits, v_bits, group_size, residual_length, scale,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None,
      rope_inv_freq=None):
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, rope_inv_freq)
    return _attend_cuda(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                        k_bits, v_bits, group_size, residual_length, scale, None, extras)


def _attend_cuda(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                 k_bits, v_bits, group_size, residual_length, scale, pool, extras):
    """CUDA attention of both attend ops: the fused Triton kernels (pooled tokens masked out of
    the cache tiles and the pool's exact K/V in the same online softmax; nuq levels and pre-RoPE
    keys, pool keys rotated to pool_pos). The sparse outlier store has no Triton kernel: the
    decomposed (graph-safe) form, one dequantized fp32 copy of the layer per call."""
    if extras.sparse:
        from .decomposed import cache_attend_decomposed

        return cache_attend_decomposed(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res,
                                       lengths, counts, k_bits, v_bits, group_size, residual_length, scale,
                                       form="materialized", pool=pool, extras=extras)
    from .triton_cache import cache_attend_triton

    return cache_attend_triton(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
                               counts, k_bits, v_bits, group_size, residual_length, scale, pool=pool, extras=extras)


# ---------------------------------------------------------------- cache with a full-precision pool
#
# The same two ops over the 9 KIVI buffers plus the pool of pool.py (sink and OTT outlier tokens):
# separate ops, so a cache without the options runs exactly the code above and allocates nothing.
#   kivi::cache_append_pool(<9 buffers>, pool_k, pool_v, pool_pos (all mutated), key, value, counts?,
#                           k_bits, v_bits, group_size, residual_length, sink_tokens, outlier_tokens)
#   kivi::cache_attend_pool(query, <9 buffers>, pool_k, pool_v, pool_pos, counts?,
#                           k_bits, v_bits, group_size, residual_length, scale) -> out
# The pool has P = sink_tokens + outlier_tokens + spill slots; spill = P - sink - outliers.
# CUDA: attention runs the fused Triton kernels (pooled tokens masked out of the cache tiles, the
# pool's exact K/V in the same online softmax); append runs the decomposed (core ATen, no host
# sync, CUDA-graph safe) formulation, OTT's selection included.
#
# Every cache op also takes KVQuant's optional inputs (extras.py: nuq levels, the sparse outlier
# store, RoPE frequencies for pre-RoPE keys) as trailing arguments, None by default. On CUDA, nuq
# levels and pre-RoPE keys run in the Triton kernels (appends with a pool are decomposed anyway);
# with the sparse outlier store the ops run the decomposed form (no Triton kernel for it).

POOL_CACHE_BUFFERS = CACHE_BUFFERS + ("pool_k", "pool_v", "pool_pos")


def check_pool_args(pool_k: Tensor, pool_v: Tensor, pool_pos: Tensor, k_res: Tensor, sink_tokens: int,
                    outlier_tokens: int) -> None:
    B, H, _, D = k_res.shape
    P = pool_pos.shape[-1] if pool_pos.dim() == 3 else -1
    if tuple(pool_k.shape) != (B, H, P, D) or tuple(pool_v.shape) != (B, H, P, D) or pool_pos.dtype != torch.int64:
        raise ValueError(f"pool_k/pool_v must be [B, H, P, D] = {(B, H, P, D)} and pool_pos int64 [B, H, P]; got "
                         f"{tuple(pool_k.shape)}, {tuple(pool_v.shape)}, {pool_pos.dtype} {tuple(pool_pos.shape)}")
    if pool_k.dtype != k_res.dtype or pool_v.dtype != k_res.dtype:
        raise ValueError(f"pool_k/pool_v must have the cache dtype {k_res.dtype}")
    for name, v in (("sink_tokens", sink_tokens), ("outlier_tokens", outlier_tokens)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if sink_tokens + outlier_tokens > P:
        raise ValueError(f"the pool has {P} slots, fewer than sink_tokens + outlier_tokens = "
                         f"{sink_tokens} + {outlier_tokens}")


@torch.library.custom_op("kivi::cache_append_pool", mutates_args=POOL_CACHE_BUFFERS + SPARSE_BUFFERS)
def cache_append_pool(
    k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, k_res: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, v_res: Tensor, lengths: Tensor,
    pool_k: Tensor, pool_v: Tensor, pool_pos: Tensor,
    key: Tensor, value: Tensor, counts: Optional[Tensor],
    k_bits: int, v_bits: int, group_size: int, residual_length: int, sink_tokens: int, outlier_tokens: int,
    k_levels: Optional[Tensor] = None, v_levels: Optional[Tensor] = None,
    k_sparse: Optional[Tensor] = None, k_sparse_idx: Optional[Tensor] = None,
    v_sparse: Optional[Tensor] = None, v_sparse_idx: Optional[Tensor] = None,
) -> None:
    check_pool_args(pool_k, pool_v, pool_pos, k_res, sink_tokens, outlier_tokens)
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx)
    cache_append_reference(
        k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
        key, value, counts, k_bits, v_bits, group_size, residual_length,
        pool=(pool_k, pool_v, pool_pos, sink_tokens, outlier_tokens), extras=extras,
    )


@cache_append_pool.register_fake
def _(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, pool_k, pool_v, pool_pos,
      key, value, counts, k_bits, v_bits, group_size, residual_length, sink_tokens, outlier_tokens,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None):
    check_pool_args(pool_k, pool_v, pool_pos, k_res, sink_tokens, outlier_tokens)
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx)
    return None


@cache_append_pool.register_kernel("cuda")
def _(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, pool_k, pool_v, pool_pos,
      key, value, counts, k_bits, v_bits, group_size, residual_length, sink_tokens, outlier_tokens,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None):
    from .decomposed import cache_append_decomposed

    check_pool_args(pool_k, pool_v, pool_pos, k_res, sink_tokens, outlier_tokens)
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx)
    cache_append_decomposed(
        k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
        key.to(k_res.dtype), value.to(v_res.dtype), counts, k_bits, v_bits, group_size, residual_length,
        pool=(pool_k, pool_v, pool_pos, sink_tokens, outlier_tokens), extras=extras,
    )


@torch.library.custom_op("kivi::cache_attend_pool", mutates_args=())
def cache_attend_pool(
    query: Tensor,
    k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, k_res: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, v_res: Tensor, lengths: Tensor,
    pool_k: Tensor, pool_v: Tensor, pool_pos: Tensor,
    counts: Optional[Tensor],
    k_bits: int, v_bits: int, group_size: int, residual_length: int, scale: float,
    k_levels: Optional[Tensor] = None, v_levels: Optional[Tensor] = None,
    k_sparse: Optional[Tensor] = None, k_sparse_idx: Optional[Tensor] = None,
    v_sparse: Optional[Tensor] = None, v_sparse_idx: Optional[Tensor] = None,
    rope_inv_freq: Optional[Tensor] = None,
) -> Tensor:
    check_pool_args(pool_k, pool_v, pool_pos, k_res, 0, 0)
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, rope_inv_freq)
    return cache_attend_reference(
        query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
        counts, k_bits, v_bits, group_size, residual_length, scale, pool=(pool_k, pool_v, pool_pos), extras=extras,
    )


@cache_attend_pool.register_fake
def _(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, pool_k, pool_v, pool_pos,
      counts, k_bits, v_bits, group_size, residual_length, scale,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None,
      rope_inv_freq=None):
    check_pool_args(pool_k, pool_v, pool_pos, k_res, 0, 0)
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, rope_inv_freq)
    return torch.empty_like(query)


@cache_attend_pool.register_kernel("cuda")
def _(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, pool_k, pool_v, pool_pos,
      counts, k_bits, v_bits, group_size, residual_length, scale,
      k_levels=None, v_levels=None, k_sparse=None, k_sparse_idx=None, v_sparse=None, v_sparse_idx=None,
      rope_inv_freq=None):
    check_pool_args(pool_k, pool_v, pool_pos, k_res, 0, 0)
    extras = checked_extras(k_codes, k_res, k_bits, v_bits, residual_length,
                            k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, rope_inv_freq)
    return _attend_cuda(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                        k_bits, v_bits, group_size, residual_length, scale, (pool_k, pool_v, pool_pos), extras)
