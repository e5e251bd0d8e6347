"""A paged KIVI layer's six page pools carved out of one byte buffer [N, page_bytes] (an engine's
opaque blocks), in PAGED_TENSORS order with paged_layout.py's shapes, strided by page_bytes."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import KIVIConfig
from ..kernels.reference.packing import packed_bytes
from ..paged_layout import PAGED_TENSORS, check_page_size


def page_shapes(config: KIVIConfig, num_kv_heads: int, page_size: int, head_dim: int) -> dict[str, tuple]:
    check_page_size(page_size, config.group_size)
    H, PS, D, G = num_kv_heads, page_size, head_dim, config.group_size
    gv = config.value_group_size(D)
    return {"k_codes": (H, PS, packed_bytes(D, config.k_bits)), "k_scale": (H, PS // G, D), "k_zero": (H, PS // G, D),
            "v_codes": (H, PS, packed_bytes(D, config.v_bits)), "v_scale": (H, PS, D // gv),
            "v_zero": (H, PS, D // gv)}


def _nbytes(name: str, shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * (1 if name.endswith("codes") else torch.empty((), dtype=dtype).element_size())


def page_bytes(config: KIVIConfig, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page of one layer (keys and values, all kv heads)."""
    return sum(_nbytes(n, s, dtype) for n, s in page_shapes(config, num_kv_heads, page_size, head_dim).items())


def pool_views(buffer: Tensor, config: KIVIConfig, num_kv_heads: int, page_size: int, head_dim: int,
               dtype: torch.dtype) -> dict[str, Tensor]:
    """The six pools as views of a contiguous buffer of N pages: no copy."""
    raw = buffer.view(torch.uint8).reshape(buffer.shape[0], -1)
    want = page_bytes(config, num_kv_heads, page_size, head_dim, dtype)
    if raw.shape[1] != want:
        raise ValueError(f"buffer must hold {want} bytes per page (k_bits={config.k_bits}, v_bits={config.v_bits}, "
                         f"group_size={config.group_size}, page_size={page_size}, heads={num_kv_heads}, "
                         f"head_dim={head_dim}, {dtype}), got {raw.shape[1]}")
    views, start = {}, 0
    for name in PAGED_TENSORS:
        shape = page_shapes(config, num_kv_heads, page_size, head_dim)[name]
        size = _nbytes(name, shape, dtype)
        part = raw[:, start:start + size]
        views[name] = (part if name.endswith("codes") else part.view(dtype)).view(raw.shape[0], *shape)
        start += size
    return views
