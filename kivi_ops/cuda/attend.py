"""attend_cuda_cpp: the CUDA C++ decode kernel (decode_attend.cu) behind the attend
implementations' signature (query, layer, counts, params, scale), and what it supports.

Plain KIVI-2 only: fp16 cache, head_dim 64 or 128, group_size a multiple of 32, at most 8 query
heads per kv head, one query token per row, no sink/OTT pool, no KVQuant part, not paged. The
dispatcher (dispatch.py) chooses it only where `unsupported` returns None and only when
KIVI_CUDA_DECODE=cuda_cpp asks for it; everything else stays on the Triton kernels.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import LayerTensors, QuantParams
from ..schedule import OTT

HEAD_DIMS = (64, 128)
MAX_QUERY_HEADS_PER_KV_HEAD = 8  # the MMA's N
MAX_SPLITS = 64
SPLIT_MIN_TOKENS = 128  # no split gets fewer of a full cache's tokens


def unsupported(layer: LayerTensors, params: QuantParams, q_len: int, query_heads: Optional[int] = None) -> Optional[str]:
    """Why the kernel does not take this call (None: it does)."""
    D = layer.k_res.shape[-1]
    if q_len != 1:
        return f"q_len {q_len} (decode only)"
    if layer.k_res.dtype != torch.float16:
        return f"cache dtype {layer.k_res.dtype} (fp16 only)"
    if D not in HEAD_DIMS:
        return f"head_dim {D} (64 or 128)"
    if params.k_bits != 2 or params.v_bits != 2:
        return f"{params.k_bits}/{params.v_bits}-bit codes (2-bit only)"
    if params.group_size % 32:
        return f"group_size {params.group_size} (a multiple of 32)"
    if layer.pool is not None or layer.extras.active:
        return "the sink/OTT pool or a KVQuant part"
    if query_heads is not None and query_heads > MAX_QUERY_HEADS_PER_KV_HEAD * layer.k_codes.shape[1]:
        return f"{query_heads} query heads on {layer.k_codes.shape[1]} kv heads (at most 8 per kv head)"
    return None


def default_num_splits(rows: int, max_tokens: int, sms: int) -> int:
    """Splits of the quantized tokens from static shapes only (CUDA-graph safe): about two blocks
    per SM over the rows * kv heads, never a split of fewer than SPLIT_MIN_TOKENS tokens."""
    wanted = -(-2 * sms // max(rows, 1))
    return max(1, min(wanted, max_tokens // SPLIT_MIN_TOKENS, MAX_SPLITS))


def attend_cuda_cpp(query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams,
                    scale: float, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """Decode attention of query [B, Hq, 1, D] over the layer (attend_reference's result within the
    fp16 bound in decode_attend.cu's header); ValueError for what `unsupported` names."""
    from .loader import load

    reason = unsupported(t, p, query.shape[2], query.shape[1])
    if reason is not None:
        raise ValueError(f"attend_cuda_cpp does not take {reason}")
    ext = load()
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    B, H, S = k_codes.shape[:3]
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        num_splits = default_num_splits(B * H, S, sms)
    out = ext.decode_attend(query.to(torch.float16).contiguous(), k_codes, k_scale, k_zero, k_res, v_codes, v_scale,
                            v_zero, v_res, lengths, None if counts is None else counts.to(torch.int64).contiguous(), p.group_size, p.residual_length,
                            int(p.flush_policy == OTT), float(scale), int(num_splits))
    return out.to(query.dtype)
