"""attend_cuda_cpp (and its paged form): the CUDA C++ decode kernel (decode_attend.cu) behind the attend
implementations' signature. `unsupported` names each call it leaves to Triton (docs/performance.md):
3- and 8-bit codes are not instantiated (a 3-bit word spans 3 bytes), more than 16 query heads per kv
head would read the codes a third time, and a 32-token chunk must lie in one key group."""

from __future__ import annotations

from typing import Optional

import torch

from ...layout import LayerTensors, QuantParams
from ...paged_layout import BLOCK_TABLE_DTYPE, Paging
from ...options.schedule import OTT

HEAD_DIMS = (64, 128, 256)
CACHE_DTYPES = (torch.float16, torch.bfloat16)
CODE_BITS = (2, 4)
MAX_QUERY_HEADS_PER_KV_HEAD = 16  # two tiles of the MMA's N = 8
MAX_SPLITS = 64
SPLIT_MIN_TOKENS = 128


def unsupported(layer: LayerTensors, params: QuantParams, q_len: int, query_heads: Optional[int] = None, *,
                paged: bool = False) -> Optional[str]:
    """Why the kernel does not take this call (None: it does)."""
    D = layer.k_res.shape[-1]
    if q_len != 1:
        return f"q_len {q_len} (decode only)"
    if layer.k_res.dtype not in CACHE_DTYPES:
        return f"cache dtype {layer.k_res.dtype} (float16 or bfloat16)"
    if D not in HEAD_DIMS:
        return f"head_dim {D} (64, 128 or 256)"
    if params.k_bits not in CODE_BITS or params.v_bits not in CODE_BITS:
        return f"{params.k_bits}/{params.v_bits}-bit codes (2 or 4 bits each)"
    if params.group_size % 32:
        return f"group_size {params.group_size} (a multiple of 32)"
    if layer.pool is not None or layer.extras.active:
        return "the sink/OTT pool or a KVQuant part"
    if paged and layer.k_codes.shape[2] % params.group_size:
        return f"page_size {layer.k_codes.shape[2]} (a multiple of group_size {params.group_size})"
    if query_heads is not None and query_heads > MAX_QUERY_HEADS_PER_KV_HEAD * layer.k_codes.shape[1]:
        return (f"{query_heads} query heads on {layer.k_codes.shape[1]} kv heads (at most "
                f"{MAX_QUERY_HEADS_PER_KV_HEAD} per kv head)")
    return None


def default_num_splits(rows: int, max_tokens: int, sms: int, blocks_per_sm: int = 2) -> int:
    """Splits from static shapes only (CUDA-graph safe): about blocks_per_sm blocks per SM."""
    wanted = -(-blocks_per_sm * sms // max(rows, 1))
    return max(1, min(wanted, max_tokens // SPLIT_MIN_TOKENS, MAX_SPLITS))


def attend_cuda_cpp(query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams,
                    scale: float, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """Decode attention of query [B, Hq, 1, D], within decode_attend.cu's bound of attend_reference."""
    return _launch(query, t, counts, p, scale, None, num_splits)


def attend_cuda_cpp_paged(query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams,
                          scale: float, pages: Paging, *, num_splits: Optional[int] = None) -> torch.Tensor:
    return _launch(query, t, counts, p, scale, pages, num_splits)


def _launch(query, t: LayerTensors, counts, p: QuantParams, scale: float, pages: Optional[Paging],
            num_splits: Optional[int]) -> torch.Tensor:
    from .loader import load

    reason = unsupported(t, p, query.shape[2], query.shape[1], paged=pages is not None)
    if reason is not None:
        raise ValueError(f"attend_cuda_cpp does not take {reason}")
    ext = load()
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    B, H = query.shape[0], k_codes.shape[1]
    S = k_codes.shape[2] if pages is None else pages.capacity
    table = None if pages is None else pages.block_table.to(BLOCK_TABLE_DTYPE).contiguous()
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        tiles = -(-query.shape[1] // (H * 8))
        num_splits = default_num_splits(B * H * tiles, S, sms, ext.variant()[2])
    out = ext.decode_attend(query.to(k_res.dtype).contiguous(), k_codes, k_scale, k_zero, k_res, v_codes, v_scale,
                            v_zero, v_res, lengths, None if counts is None else counts.to(torch.int64).contiguous(),
                            p.group_size, p.residual_length, int(p.flush_policy == OTT), float(scale),
                            int(num_splits), table)
    return out.to(query.dtype)
