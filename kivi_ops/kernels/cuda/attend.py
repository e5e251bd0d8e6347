"""attend_cuda_cpp: the CUDA C++ decode kernel (decode_attend.cu) behind the attend
implementations' signature (query, layer, counts, params, scale), its paged form
attend_cuda_cpp_paged (the same plus a paged_layout.Paging), and what it supports.

Takes: 2- or 4-bit keys and values (each its own width), an fp16 or bf16 cache (bf16 MMAs and
unpack for bf16: decode_attend.cu's header), head_dim 64, 128 or 256,
group_size a multiple of 32, 1 to 16 query heads per kv head (8 per block, the MMA's N: 9 to 16
take two blocks, which read the same codes, the second mostly from L2), one query token per row,
static or paged (block table; a page holds whole key groups, so whole 32-token chunks), either
flush policy.
Falls back to Triton (`unsupported` names the reason; the dispatcher runs Triton):
    q_len > 1 (prefill, verify)              decode only
    fp32 caches                              16-bit MMA inputs only (fp16, bf16)
    3- or 8-bit codes                        not instantiated (a 3-bit word spans 3 bytes)
    head_dim other than 64, 128, 256         not instantiated
    more than 16 query heads per kv head     a third tile would read the codes a third time
    group_size not a multiple of 32          a 32-token chunk is one key group's share
    the sink/OTT outlier pool, KVQuant parts (nuq levels, sparse store, pre-RoPE keys)
The dispatcher (dispatch.py) makes it eligible only where `unsupported` returns None; among the
eligible kernels it runs the one the tuning table or a one-time autotune picks for the call's shape
class (KIVI_CUDA_DECODE=auto, the default; =cuda_cpp forces it, =triton never runs it).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...layout import LayerTensors, QuantParams
from ...paged_layout import BLOCK_TABLE_DTYPE, Paging
from ...options.schedule import OTT

HEAD_DIMS = (64, 128, 256)
CACHE_DTYPES = (torch.float16, torch.bfloat16)  # the query is cast to the cache's dtype
CODE_BITS = (2, 4)  # key and value widths, any pair (decode_attend.cu's split_kernel)
MAX_QUERY_HEADS_PER_KV_HEAD = 16  # two tiles of the MMA's N = 8
MAX_SPLITS = 64
SPLIT_MIN_TOKENS = 128  # no split gets fewer of a full cache's tokens


def unsupported(layer: LayerTensors, params: QuantParams, q_len: int, query_heads: Optional[int] = None, *,
                paged: bool = False) -> Optional[str]:
    """Why the kernel does not take this call (None: it does). paged: the layer is a paged one
    (its code buffers are page pools; the kernel reads them through the block table)."""
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
    if paged and layer.k_codes.shape[2] % params.group_size:  # paged_layout refuses these too
        return f"page_size {layer.k_codes.shape[2]} (a multiple of group_size {params.group_size})"
    if query_heads is not None and query_heads > MAX_QUERY_HEADS_PER_KV_HEAD * layer.k_codes.shape[1]:
        return (f"{query_heads} query heads on {layer.k_codes.shape[1]} kv heads (at most "
                f"{MAX_QUERY_HEADS_PER_KV_HEAD} per kv head)")
    return None


def default_num_splits(rows: int, max_tokens: int, sms: int, blocks_per_sm: int = 2) -> int:
    """Splits of the quantized tokens from static shapes only (CUDA-graph safe): about blocks_per_sm
    blocks per SM over the rows * kv heads (the kernel's build says how many: KIVI_DECODE_BLOCKS_PER_SM),
    never a split of fewer than SPLIT_MIN_TOKENS tokens."""
    wanted = -(-blocks_per_sm * sms // max(rows, 1))
    return max(1, min(wanted, max_tokens // SPLIT_MIN_TOKENS, MAX_SPLITS))


def attend_cuda_cpp(query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams,
                    scale: float, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """Decode attention of query [B, Hq, 1, D] over the layer (attend_reference's result within the
    bound in decode_attend.cu's header: fp16's or bf16's); ValueError for what `unsupported` names."""
    return _launch(query, t, counts, p, scale, None, num_splits)


def attend_cuda_cpp_paged(query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams,
                          scale: float, pages: Paging, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """attend_cuda_cpp on a paged layer (paged_layout.py): paged_attend_reference's result within the
    same bound. The block table is read on the device (no host sync: CUDA-graph capturable)."""
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
    # the kernel reads int32 ids (the cache's own dtype: a no-op there; an int64 table is converted)
    table = None if pages is None else pages.block_table.to(BLOCK_TABLE_DTYPE).contiguous()
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        tiles = -(-query.shape[1] // (H * 8))  # blocks per kv row (8 query heads each)
        num_splits = default_num_splits(B * H * tiles, S, sms, ext.variant()[2])
    out = ext.decode_attend(query.to(k_res.dtype).contiguous(), k_codes, k_scale, k_zero, k_res, v_codes, v_scale,
                            v_zero, v_res, lengths, None if counts is None else counts.to(torch.int64).contiguous(),
                            p.group_size, p.residual_length, int(p.flush_policy == OTT), float(scale),
                            int(num_splits), table)
    return out.to(query.dtype)
