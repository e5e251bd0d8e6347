"""Tensor-core decode attention over the plain KIVI cache (q_len == 1): attend_decode_mma.

A candidate for the GPU decode kernel, built from the techniques of the fastest low-bit decode
kernels (BitDecoding, LMDeploy TurboMind: GQA heads packed into the MMA rows, scale and zero
folded out of the inner loop) and chosen by the static issue model (lab/issue_model.py: SASS
instructions per token of the steady-state loop against the bandwidth budget), because no GPU
was at hand to time it. It lives in the lab, not dispatched, until a GPU run times it against
attend_decode (lab/gpu_suite.sh sweep).

_attend_decode_mma_kernel grid (B*H, num_splits): one program per (batch row, kv head, split)
runs all QG query heads of its kv head as the rows of one tensor-core tile (BitDecoding's GQA
packing, padded to M_P >= 16 rows), so each code byte is loaded once per kv head, not once per
query head. Tiles of BLOCK_N tokens (BLOCK_N divides G: one key group per tile):
  - keys, fast tiles (every token quantized): the group's scale folds into the query and its
    zero into one dot per group, q . (c s + z) = (q s) . c + q . z, so the key tile goes to
    tl.dot as bare codes (exact small integers in fp16/bf16), with no per-element dequantize;
  - codes unpack with tl.interleave into the natural channel order (no reshape of a broadcast,
    which the split kernel pays for in shared-memory round trips). magic=True converts them to
    fp16/bf16 by the magic-number trick (OR into the mantissa of 1024.0 / 128.0, bitcast,
    subtract) instead of an integer-to-float conversion; off by default, because Triton turns
    the 16-bit truncation into byte permutes and the issue model counts more integer-pipe
    cycles with it than the conversions it saves (results/issue_model_sm90.json);
  - values dequantize per element (per-token scale of each GV-channel group), in the cache dtype
    on GPU (c s + z as one fma per element pair, clamped to the finite range), and p rounds to
    the cache dtype; both products accumulate in fp32 (the split kernel's numerics, like fp16
    flash attention);
  - the last tiles (residual window, <= R + G tokens) take the mixed path: keys dequantized or
    read from the residual ring per token.
Splits merge in _attend_reduce_kernel (kivi_ops/kernels/triton/attend.py), as for the other kernels. CUDA-graph
safe: static grid, every length predicated inside.

Scope: plain KIVI caches (no pool, nuq levels, pre-RoPE keys or sparse store: attend_decode
takes those), power-of-two head_dim >= 16.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kivi_ops.layout import LayerTensors, QuantParams
from kivi_ops.kernels.reference.packing import codes_per_byte
from kivi_ops.kernels.triton.attend import (LOG2E, _cast, _cast_sat, attend_num_splits, attend_setup, launch_reduce,
                                            split_workspace)
from kivi_ops.kernels.triton.quant import _BF16_MAX, _FP16_MAX, device_ctx, interpreting, next_pow2

MMA_BLOCK_N = 32  # tokens per tile, at most G (one key group per tile)
MMA_NUM_WARPS = 4
MMA_PROGRAMS_PER_SM = 4


@triton.jit
def _unpack_natural(byte, BITS: tl.constexpr, PER: tl.constexpr):
    """uint8 codes [N, NB] -> int32 [N, NB * PER] in channel order: column j * PER + i is code i
    of byte j (layout.py's packing). tl.interleave keeps the new axis in each thread's registers."""
    x = byte.to(tl.int32)
    MASK: tl.constexpr = (1 << BITS) - 1
    if PER == 1:
        return x
    elif PER == 2:
        return tl.interleave(x & MASK, (x >> BITS) & MASK)
    else:  # PER == 4: interleave(c0, c2) then with interleave(c1, c3) gives c0 c1 c2 c3 per byte
        even = tl.interleave(x & MASK, (x >> (2 * BITS)) & MASK)
        odd = tl.interleave((x >> BITS) & MASK, (x >> (3 * BITS)) & MASK)
        return tl.interleave(even, odd)


@triton.jit
def _codes_to(codes, DT: tl.constexpr, MAGIC: tl.constexpr):
    """int32 codes (< 128) -> DT exactly. MAGIC: OR the code into the mantissa of 1024.0 (fp16)
    or 128.0 (bf16), bitcast and subtract: bit operations instead of an int-to-float conversion,
    which Hopper issues at a fraction of the ALU rate."""
    if MAGIC:
        if DT == tl.float16:
            return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        else:
            return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        return codes.to(tl.float32).to(DT)  # via fp32: the interpreter has no int -> bf16 cast


@triton.jit
def _clamp_finite(x, DT: tl.constexpr):
    """x clamped to DT's finite range with two min/max (NaN kept): what saturate() does with
    compares and selects, in half the instructions; in fp16/bf16 arithmetic it also maps an
    overflowed +-inf back to the largest finite value, as saturating before the cast would."""
    if DT == tl.float16:
        return tl.clamp(x, -_FP16_MAX, _FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
    elif DT == tl.bfloat16:
        return tl.clamp(x, -_BF16_MAX, _BF16_MAX, propagate_nan=tl.PropagateNan.ALL)
    else:
        return x


@triton.jit
def _dot(a, b, OP_DT: tl.constexpr):
    """a @ b with fp32 accumulation: tensor cores for fp16/bf16 operands, exact fp32 products
    ("ieee") for fp32 ones (tf32 would round them)."""
    if OP_DT == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mma_tile(
    acc, m_i, l_i, q, q_op, t0, hi, nqk, nqv, bh64, S, NSG,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res,
    MIXED: tl.constexpr, LOWP_MATH: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr,
    V_BITS: tl.constexpr, V_PER: tl.constexpr, G: tl.constexpr, NGV: tl.constexpr, GV: tl.constexpr,
    R: tl.constexpr, RR: tl.constexpr, BLOCK_N: tl.constexpr, OP_DT: tl.constexpr, MAGIC: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """One online-softmax step of the M_P query rows over tokens [t0, t0 + BLOCK_N), one key
    group. MIXED=False: every token quantized for keys and values; MIXED=True: tokens >= hi
    masked, each key / value from its codes or its residual ring slot (module doc)."""
    DT = k_res.dtype.element_ty
    t = t0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row = bh64 * S + t
    jk = tl.arange(0, D // K_PER)
    ks_off = (bh64 * NSG + t0 // G) * D + d
    if MIXED:
        kq = t < nqk
        kb = tl.load(k_codes + row[:, None] * (D // K_PER) + jk[None, :], mask=kq[:, None], other=0)
        ks = tl.load(k_scale + ks_off, mask=t0 < nqk, other=0.0).to(tl.float32)
        kz = tl.load(k_zero + ks_off, mask=t0 < nqk, other=0.0).to(tl.float32)
        kdq = _unpack_natural(kb, K_BITS, K_PER).to(tl.float32) * ks[None, :] + kz[None, :]
        kres = tl.load(k_res + (bh64 * RR + t % R)[:, None] * D + d[None, :],
                       mask=((t < hi) & (t >= nqk))[:, None], other=0.0).to(tl.float32)
        k = _cast_sat(tl.where(kq[:, None], kdq, kres), DT, EMULATE_RTNE).to(OP_DT)
        s = _dot(q_op, tl.trans(k), OP_DT)
        s = tl.where((t < hi)[None, :], s, float("-inf"))
    else:
        # (q s) . c + q . z: the tile's codes go to the tensor cores as they are
        kb = tl.load(k_codes + row[:, None] * (D // K_PER) + jk[None, :])
        ks = tl.load(k_scale + ks_off).to(tl.float32)
        kz = tl.load(k_zero + ks_off).to(tl.float32)
        qs = _cast(_clamp_finite(q * ks[None, :], DT), DT, EMULATE_RTNE).to(OP_DT)
        kc = _codes_to(_unpack_natural(kb, K_BITS, K_PER), DT, MAGIC).to(OP_DT)
        s = _dot(qs, tl.trans(kc), OP_DT) + tl.sum(q * kz[None, :], axis=1)[:, None]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: token t0 < hi is visible
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)

    jv = tl.arange(0, D // V_PER)
    vs_off = row[:, None] * NGV + (d // GV)[None, :]
    if MIXED:
        vq = t < nqv
        vb = tl.load(v_codes + row[:, None] * (D // V_PER) + jv[None, :], mask=vq[:, None], other=0)
        vs = tl.load(v_scale + vs_off, mask=vq[:, None], other=0.0).to(tl.float32)
        vz = tl.load(v_zero + vs_off, mask=vq[:, None], other=0.0).to(tl.float32)
        vres = tl.load(v_res + (bh64 * RR + t % R)[:, None] * D + d[None, :],
                       mask=((t < hi) & (t >= nqv))[:, None], other=0.0).to(tl.float32)
        v = tl.where(vq[:, None], _unpack_natural(vb, V_BITS, V_PER).to(tl.float32) * vs + vz, vres)
        v = _cast_sat(v, DT, EMULATE_RTNE)
    else:
        vb = tl.load(v_codes + row[:, None] * (D // V_PER) + jv[None, :])
        vs = tl.load(v_scale + vs_off)
        vz = tl.load(v_zero + vs_off)
        vc = _unpack_natural(vb, V_BITS, V_PER)
        if LOWP_MATH:  # c s + z in the cache dtype (one fma per element pair), then clamped
            v = _clamp_finite(_codes_to(vc, DT, MAGIC) * vs + vz, DT)
        else:
            v = _cast_sat(vc.to(tl.float32) * vs.to(tl.float32) + vz.to(tl.float32), DT, EMULATE_RTNE)
    p_op = _cast(p, DT, EMULATE_RTNE).to(OP_DT)  # p in [0, 1]: nothing to saturate
    acc = acc * alpha[:, None] + _dot(p_op, v.to(OP_DT), OP_DT)
    return acc, m_new, l_i


@triton.jit
def _attend_decode_mma_kernel(
    q_ptr, s_qb, s_qh, s_qd,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths_ptr, counts_ptr,
    ws_m, ws_l, ws_acc, out_ptr,
    H, S, NSG, qk_scale,
    HAS_COUNTS: tl.constexpr, QG: tl.constexpr, M_P: tl.constexpr, D: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGV: tl.constexpr, GV: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, OP_DT: tl.constexpr, MAGIC: tl.constexpr,
    LOWP_MATH: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // H
    bh64 = bh.to(tl.int64)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    nqk = (L // R) * R
    nqv = tl.maximum(L - R, 0)

    m = tl.arange(0, M_P)
    d = tl.arange(0, D)
    hq = (bh % H) * QG + m  # the query heads of this kv head; rows >= QG are padding (zeros)
    q_off = b.to(tl.int64) * s_qb + hq.to(tl.int64)[:, None] * s_qh + d.to(tl.int64)[None, :] * s_qd
    q = tl.load(q_ptr + q_off, mask=(m < QG)[:, None], other=0.0).to(tl.float32) * qk_scale  # base 2
    q_op = _cast_sat(q, k_res.dtype.element_ty, EMULATE_RTNE).to(OP_DT)  # the mixed tiles' operand

    split_len = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    if HAS_COUNTS:
        hi = tl.where(tl.load(counts_ptr + b) > 0, hi, lo)  # a padded row attends to nothing: 0
    mid = tl.maximum(tl.minimum((tl.minimum(nqk, nqv) // BLOCK_N) * BLOCK_N, hi), lo)

    m_i = tl.full([M_P], float("-inf"), tl.float32)
    l_i = tl.zeros([M_P], tl.float32)
    acc = tl.zeros([M_P, D], tl.float32)
    for t0 in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _mma_tile(
            acc, m_i, l_i, q, q_op, t0, hi, nqk, nqv, bh64, S, NSG,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res,
            False, LOWP_MATH, D, K_BITS, K_PER, V_BITS, V_PER, G, NGV, GV, R, RR, BLOCK_N, OP_DT, MAGIC, EMULATE_RTNE,
        )
    for t0 in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _mma_tile(
            acc, m_i, l_i, q, q_op, t0, hi, nqk, nqv, bh64, S, NSG,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res,
            True, LOWP_MATH, D, K_BITS, K_PER, V_BITS, V_PER, G, NGV, GV, R, RR, BLOCK_N, OP_DT, MAGIC, EMULATE_RTNE,
        )

    rows = (bh64 * QG + m)[:, None]
    if NUM_SPLITS == 1:
        o = tl.math.div_rn(acc, tl.zeros_like(acc) + tl.where(l_i > 0.0, l_i, 1.0)[:, None])
        o = tl.where((l_i > 0.0)[:, None], o, 0.0)
        tl.store(out_ptr + rows * D + d[None, :], _cast_sat(o, out_ptr.dtype.element_ty, EMULATE_RTNE),
                 mask=(m < QG)[:, None])
    else:
        w = (bh64 * NUM_SPLITS + sp) * QG + m
        tl.store(ws_m + w, m_i, mask=m < QG)
        tl.store(ws_l + w, l_i, mask=m < QG)
        tl.store(ws_acc + w[:, None] * D + d[None, :], acc, mask=(m < QG)[:, None])


def mma_supports(t: LayerTensors, p: QuantParams) -> bool:
    """Whether attend_decode_mma takes this layer: plain KIVI (KIVI's flush policy), a power-of-two
    head_dim >= 16 and group_size >= 16 (a tile of >= 16 tokens, tl.dot's least, lies in one key group)."""
    head_dim = t.k_res.shape[-1]
    return (t.pool is None and not t.extras.active and head_dim >= 16 and not head_dim & (head_dim - 1)
            and p.group_size >= 16 and p.flush_policy == 0)


def attend_decode_mma(
    query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams, scale: float, *,
    num_splits: Optional[int] = None, block_n: Optional[int] = None, num_warps: Optional[int] = None,
    num_stages: int = 2, magic: bool = False,
) -> torch.Tensor:
    """Attention of one query per row, query [B, Hq, 1, D], over a plain KIVI cache, like
    attend_reference (module doc); anything else is a ValueError naming what to use instead.
    num_splits / block_n / num_warps / num_stages / magic override the static choices (tests,
    tuning; magic=True converts codes by the magic-number trick, fp16/bf16 caches only)."""
    (B, H, S, D, R, RR, G, gv), _, out = attend_setup(query, t, p)
    Hq, q_len = query.shape[1], query.shape[2]
    if q_len != 1:
        raise ValueError(f"attend_decode_mma takes one query per row (q_len == 1), got q_len={q_len}")
    if not mma_supports(t, p):
        raise ValueError("attend_decode_mma takes plain KIVI caches with a power-of-two head_dim >= 16 and "
                         f"group_size >= 16 (head_dim={D}, group_size={G}, pool={t.pool is not None}, "
                         f"KVQuant extras={t.extras.active}, flush_policy={p.flush_policy}); attend_decode takes the rest")
    if out.numel() == 0:
        return out
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    QG = Hq // H
    block_n = block_n or min(MMA_BLOCK_N, G)
    if block_n < 16 or block_n & (block_n - 1) or G % block_n:
        raise ValueError(f"block_n must be a power of two >= 16 that divides group_size={G}, got {block_n}")
    num_splits = attend_num_splits(B * H, S, block_n, query.device, programs_per_sm=MMA_PROGRAMS_PER_SM,
                                   requested=num_splits)
    interp = interpreting()
    lowp = k_res.dtype != torch.float32
    # The interpreter's tl.dot takes no bf16 (numpy has none): the operands, exact in the cache
    # dtype, go up to fp32 there, which gives the tensor-core products. fp32 caches: tf32 would
    # round the operands, so they stay fp32 ("ieee") everywhere.
    op_dt = tl.float32 if (interp or not lowp) else (tl.float16 if k_res.dtype == torch.float16 else tl.bfloat16)
    if magic and not lowp:
        raise ValueError("magic=True needs an fp16 or bf16 cache")
    # Values dequantize in the cache dtype on GPU; the interpreter has no bf16 arithmetic, so a
    # bf16 cache there dequantizes in fp32 and rounds (within the same rounding of the result).
    lowp_math = lowp and not (interp and k_res.dtype == torch.bfloat16)
    if query.dtype != k_res.dtype:
        query = query.to(k_res.dtype)
    has_counts = counts is not None
    ws_m, ws_l, ws_acc = split_workspace(B * H, num_splits, QG, D, out)
    with device_ctx(query):
        torch.library.wrap_triton(_attend_decode_mma_kernel)[(B * H, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(3),
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
            counts if has_counts else lengths, ws_m, ws_l, ws_acc, out,
            H, S, k_scale.shape[2], float(scale) * LOG2E,
            HAS_COUNTS=has_counts, QG=QG, M_P=max(16, next_pow2(QG)), D=D,
            K_BITS=p.k_bits, K_PER=codes_per_byte(p.k_bits), V_BITS=p.v_bits, V_PER=codes_per_byte(p.v_bits),
            G=G, NGV=D // gv, GV=gv, R=R, RR=RR, BLOCK_N=block_n, NUM_SPLITS=num_splits, OP_DT=op_dt,
            MAGIC=magic, LOWP_MATH=lowp_math, EMULATE_RTNE=interp,
            num_warps=num_warps or MMA_NUM_WARPS, num_stages=num_stages,
        )
        if num_splits > 1:
            launch_reduce(ws_m, ws_l, ws_acc, out, B * H, QG, QG, num_splits)
    return out
