"""What the Triton cache launchers share: the layer checks, and for the two attention kernels their jit
helpers, the split merge and its workspace. Both are CUDA-graph-safe flash decoding: static grids, each
program cuts its token range at run time from the sequence's own length. The pool's tokens run in split
0; cos/sin of pre-RoPE keys are computed in-kernel (an [S, D] table would read more than the codes)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...options.extras import Extras, check_extras
from ...options.schedule import OTT, residual_slots
from ...layout import REQUIRED_TENSORS, LayerTensors, QuantParams
from ..reference.packing import codes_per_word, packed_bytes, token_group_size
from .args import option_args
from .quant import interpreting, next_pow2, saturate, to_dtype_rtne

LOG2E = 1.0 / math.log(2.0)
MAX_SPLITS = 64


def check_cache(t: LayerTensors, p: QuantParams):
    """Checks the nine KIVI tensors against each other and p: (B, H, S, D, R, RR, G, Gv)."""
    for name, x in zip(REQUIRED_TENSORS, t.kivi):
        if not x.is_contiguous():
            raise ValueError(f"cache buffer {name} must be contiguous (a whole registered buffer)")
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    k_bits, v_bits = p.k_bits, p.v_bits
    B, H, S, _ = k_codes.shape
    R, G = p.residual_length, p.group_size
    D = k_res.shape[-1]
    if R % G and p.flush_policy != OTT:
        raise ValueError(f"residual_length={R} must be a multiple of group_size={G} (flush_policy kivi)")
    if k_codes.shape[-1] != packed_bytes(D, k_bits) or v_codes.shape[-1] != packed_bytes(D, v_bits):
        raise ValueError("k_codes/v_codes last dim does not match head_dim at the given bits")
    # A cache shorter than the residual ring holds only S residual rows.
    RR = min(residual_slots(p.flush_policy, R, G), S)
    if tuple(k_res.shape) != (B, H, RR, D) or tuple(v_res.shape) != (B, H, RR, D):
        raise ValueError(f"k_res/v_res must have shape {(B, H, RR, D)}")
    gv = token_group_size(G, D)
    if gv % codes_per_word(v_bits):
        raise ValueError(f"v_bits={v_bits} packs {codes_per_word(v_bits)} codes per word: the value group "
                         f"min(group_size, head_dim) = {gv} must hold whole words")
    if D % gv or tuple(v_scale.shape) != (B, H, S, D // gv):
        raise ValueError(f"v_scale must have shape {(B, H, S, D // gv)}")
    if tuple(k_scale.shape) != (B, H, -(-S // G), D):
        raise ValueError(f"k_scale must have shape {(B, H, -(-S // G), D)}")
    return B, H, S, D, R, RR, G, gv


def check_kernel_extras(t: LayerTensors, p: QuantParams, sparse_ok: bool = False) -> Extras:
    """The extras the kernels take, checked and made contiguous."""
    extras = t.extras
    if extras.sparse and not sparse_ok:
        raise ValueError("this Triton cache kernel does not take the dense-and-sparse outlier store")
    check_extras(extras, t.k_codes, t.k_res, p.k_bits, p.v_bits, p.residual_length)
    return Extras(*(None if x is None else x.contiguous() for x in extras))


@triton.jit
def _cast(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    if EMULATE_RTNE:
        return to_dtype_rtne(x, DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def _cast_sat(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """_cast saturated first: dequantized values can round past the dtype's max (fp16: 65536)."""
    return _cast(saturate(x, DTYPE), DTYPE, EMULATE_RTNE)


@triton.jit
def _in_pool(t, pp):
    """[T] bool: t[i] is a pooled position of pp [P_P] (-1, empty, never matches)."""
    return tl.max((t[:, None] == pp[None, :]).to(tl.int32), axis=1) > 0


@triton.jit
def _quantized_counts(L, R: tl.constexpr, G: tl.constexpr, OTT: tl.constexpr):
    """(nqk, nqv): quantized keys and values of a row's L tokens (schedule.py)."""
    if OTT:
        nqk = (tl.maximum(L - R, 0) // G) * G
        nqv = nqk
    else:
        nqk = (L // R) * R
        nqv = tl.maximum(L - R, 0)
    return nqk, nqv


@triton.jit
def _load_pool_positions(pool_pos, bh64, P, P_P: tl.constexpr, HAS_POOL: tl.constexpr):
    """Pooled positions [P_P] of kv head bh64 (-1 = empty; all -1 without a pool)."""
    pp = tl.full([P_P], -1, tl.int32)
    if HAS_POOL:
        j = tl.arange(0, P_P)
        pp = tl.load(pool_pos + bh64 * P + j, mask=j < P, other=-1).to(tl.int32)
    return pp


@triton.jit
def _code_values(codes, levels, HAS_LEVELS: tl.constexpr):
    if HAS_LEVELS:
        return tl.load(levels + codes)
    else:
        return codes.to(tl.float32)


@triton.jit
def _rope_cos_sin(positions, freq):
    """cos and sin of positions * freq in fp32 like rope.rope_at; libdevice's full-range cosf/sinf."""
    angle = positions.to(tl.float32) * freq
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _attend_reduce_kernel(
    ws_m, ws_l, ws_acc, out_ptr, M, M_PAD,
    D: tl.constexpr, D_P: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    rid = tl.program_id(0).to(tl.int64)
    bh = rid // M
    r = rid % M
    sidx = tl.arange(0, SPLITS_P)
    smask = sidx < NUM_SPLITS
    w = (bh * NUM_SPLITS + sidx) * M_PAD + r
    m = tl.load(ws_m + w, mask=smask, other=float("-inf"))
    l = tl.load(ws_l + w, mask=smask, other=0.0)
    gmax = tl.max(m, axis=0)
    gmax = tl.where(gmax == float("-inf"), 0.0, gmax)
    wt = tl.math.exp2(m - gmax)  # empty splits (m = -inf) weigh 0
    l_tot = tl.sum(wt * l, axis=0)
    d = tl.arange(0, D_P)
    dmask = d < D
    acc = tl.load(ws_acc + w[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(wt[:, None] * acc, axis=0)
    o = tl.math.div_rn(o, tl.zeros_like(o) + tl.where(l_tot > 0.0, l_tot, 1.0))
    o = tl.where(l_tot > 0.0, o, 0.0)
    tl.store(out_ptr + (bh * M + r) * D + d, _cast_sat(o, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=dmask)


_SM_COUNT: dict = {}


def num_programs_target(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a few splits, to exercise the merge
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return 2 * _SM_COUNT[idx]


def attend_num_splits(programs: int, max_seq_len: int, block_n: int, device, *, programs_per_sm: int = 2,
                      requested=None) -> int:
    """Token-axis splits from static shapes only (CUDA-graph safe); `requested` clamped to [1, MAX_SPLITS]."""
    if requested is None:
        target = num_programs_target(torch.device(device)) // 2 * programs_per_sm
        requested = min(triton.cdiv(target, max(1, programs)), triton.cdiv(max(max_seq_len, 1), block_n))
    return max(1, min(int(requested), MAX_SPLITS))


def split_workspace(rows: int, num_splits: int, m: int, D: int, out: torch.Tensor):
    """fp32 (max, sum, partial output) per split; none for one split (the kernel writes `out`)."""
    if num_splits == 1:
        return out, out, out
    ws_m = torch.empty((rows, num_splits, m), dtype=torch.float32, device=out.device)
    return ws_m, torch.empty_like(ws_m), torch.empty((rows, num_splits, m, D), dtype=torch.float32, device=out.device)


def launch_reduce(ws_m, ws_l, ws_acc, out, kv_rows: int, M: int, m_pad: int, num_splits: int) -> None:
    """Merge the splits into `out`; call inside the launch's device context."""
    D = out.shape[-1]
    torch.library.wrap_triton(_attend_reduce_kernel)[(kv_rows * M,)](
        ws_m, ws_l, ws_acc, out, M, m_pad,
        D=D, D_P=next_pow2(D), NUM_SPLITS=num_splits, SPLITS_P=next_pow2(num_splits),
        EMULATE_RTNE=interpreting(), num_warps=4,
    )


def attend_setup(query: torch.Tensor, t: LayerTensors, p: QuantParams, pages=None):
    """Checks both attention launchers start with: (cache dims, option arguments, the output)."""
    if pages is None:
        dims = check_cache(t, p)
    else:
        from .paging import static_dims

        dims = static_dims(t, p, pages)
    B, H, S, D = dims[:4]
    options = option_args(t, p, check_kernel_extras(t, p, sparse_ok=True))
    Bq, Hq, q_len, Dq = query.shape
    if Bq != B or Dq != D or Hq % H:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache (B={B}, H={H}, D={D})")
    out = torch.empty((B, Hq, q_len, D), dtype=query.dtype, device=query.device)
    return dims, options, out
