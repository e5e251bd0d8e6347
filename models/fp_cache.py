"""FPCache: the unquantized static-cache baseline, with KIVICache's interface.

Same append/attend contract (per-sequence lengths as device tensors, right-padded batches with
counts, causal q_len > 1), so the generation loop and the attention module do not care which
cache they hold. Plain PyTorch: it compiles and graph-captures as is.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from kivi_ops.cache import StaticCacheBase


class FPCache(StaticCacheBase):
    def __init__(self, *, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(num_layers=num_layers, batch_size=batch_size, max_seq_len=max_seq_len,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        # One spare row past max_seq_len takes the writes of padding tokens, which are never read.
        shape = (batch_size, num_kv_heads, max_seq_len + 1, head_dim)
        for layer in range(num_layers):
            self.register_buffer(f"k_{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v_{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"lengths_{layer}", torch.zeros(batch_size, dtype=torch.int64, device=device),
                                 persistent=False)

    def nbytes(self) -> int:
        """Bytes of the K/V rows a sequence can use (the spare padding row is not counted)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * self.num_layers * self.batch_size * self.num_kv_heads * self.head_dim * elem
        return per_token * self.max_seq_len

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        lengths = self.lengths(layer_idx)
        n = key.shape[2]
        if not torch.compiler.is_compiling():
            added = n if counts is None else counts
            if bool((lengths + added > self.max_seq_len).any()):
                raise ValueError(f"FPCache is full: appending {n} tokens would exceed max_seq_len={self.max_seq_len}")
        B, H = key.shape[:2]
        i = torch.arange(n, device=key.device)
        pos = lengths[:, None] + i[None, :]  # [B, n]
        if counts is not None:
            pos = torch.where(i[None, :] < counts[:, None], pos, self.max_seq_len)
        pos = pos.clamp(max=self.max_seq_len)
        # index_put_ on (batch, head, position) rows, not scatter_ along dim 2: under Inductor
        # (torch 2.13, CPU) a scatter_ into a cache buffer is functionalized into a scatter on a
        # full copy of the buffer plus a copy back (two full-cache copies per layer per step),
        # while index_put_ is re-inplaced into a kernel that writes only the new rows. Several
        # padding tokens may land on the spare row; which one wins does not matter (never read).
        idx = (torch.arange(B, device=key.device)[:, None, None], torch.arange(H, device=key.device)[None, :, None],
               pos[:, None, :])  # broadcast to [B, H, n]
        getattr(self, f"k_{layer_idx}").index_put_(idx, key)
        getattr(self, f"v_{layer_idx}").index_put_(idx, value)
        lengths += n if counts is None else counts

    def attend(self, layer_idx: int, query: torch.Tensor, scale: Optional[float] = None,
               counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        lengths = self.lengths(layer_idx)
        q = query.shape[2]
        counts = torch.full_like(lengths, q) if counts is None else counts
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]  # [B, q]
        t = torch.arange(self.max_seq_len + 1, device=query.device)
        visible = t[None, None, :] <= pos[:, :, None]  # [B, q, S+1]
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(
            query, getattr(self, f"k_{layer_idx}"), getattr(self, f"v_{layer_idx}"),
            attn_mask=visible[:, None], scale=scale, enable_gqa=True,
        )
