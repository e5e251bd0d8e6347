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
from torch import nn

from kivi_ops.cache import StaticCacheBase


class FPLayer(nn.Module):
    """One layer: keys, values [B, H, S + 1, D] and lengths [B]. The spare row past max_seq_len
    takes the writes of padding tokens, which are never read."""

    def __init__(self, shape, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lengths", torch.zeros(shape[0], dtype=torch.int64, device=device), persistent=False)

    def reset(self) -> None:
        for buf in (self.k, self.v, self.lengths):
            buf.zero_()

    def restart_rows(self, fresh: torch.Tensor) -> None:
        self.lengths.copy_(torch.where(fresh, torch.zeros_like(self.lengths), self.lengths))


class FPCache(StaticCacheBase):
    def __init__(self, *, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(num_layers=num_layers, batch_size=batch_size, max_seq_len=max_seq_len,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        shape = (batch_size, num_kv_heads, max_seq_len + 1, head_dim)
        self.layers = nn.ModuleList(FPLayer(shape, dtype, device) for _ in range(num_layers))

    def nbytes(self) -> int:
        """Bytes of the K/V rows a sequence can use (the spare padding row is not counted)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * self.num_layers * self.batch_size * self.num_kv_heads * self.head_dim * elem
        return per_token * self.max_seq_len

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        self.append_to(self.layers[layer_idx], key, value, counts)

    def attend(self, layer_idx: int, query: torch.Tensor, scale: Optional[float] = None,
               counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.attend_to(self.layers[layer_idx], query, scale, counts)

    def append_to(self, layer: FPLayer, key: torch.Tensor, value: torch.Tensor,
                  counts: Optional[torch.Tensor] = None) -> None:
        lengths = layer.lengths
        n = key.shape[2]
        self._check_counts(counts, n, lengths.device)
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
        layer.k.index_put_(idx, key)
        layer.v.index_put_(idx, value)
        lengths += n if counts is None else counts

    def attend_to(self, layer: FPLayer, query: torch.Tensor, scale: Optional[float] = None,
                  counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        lengths = layer.lengths
        q = query.shape[2]
        self._check_counts(counts, q, lengths.device)
        counts = torch.full_like(lengths, q) if counts is None else counts
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]  # [B, q]
        t = torch.arange(self.max_seq_len + 1, device=query.device)
        visible = t[None, None, :] <= pos[:, :, None]  # [B, q, S+1]
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(
            query, layer.k, layer.v,
            attn_mask=visible[:, None], scale=scale, enable_gqa=True,
        )

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, max length, head_dim] as stored (KIVICache's contract)."""
        layer = self.layers[layer_idx]
        n = int(layer.lengths.max())
        return layer.k[:, :, :n], layer.v[:, :, :n]
