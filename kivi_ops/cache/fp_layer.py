"""Unquantized static-cache baseline with KIVILayer's interface, in plain PyTorch."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .layer import CacheLayer
from .step import DECODE, Step


class FPLayer(CacheLayer):
    """Keys and values [B, H, S + 1, D]; the spare row takes padding writes, never read."""

    def __init__(self, *, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device)
        shape = (batch_size, num_kv_heads, max_seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def nbytes(self) -> int:
        return 2 * self.batch_size * self.num_kv_heads * self.head_dim * self.k.element_size() * self.max_seq_len

    def reset(self) -> None:
        for buf in (self.k, self.v, self.lengths):
            buf.zero_()

    def append(self, key: torch.Tensor, value: torch.Tensor, step: Step = DECODE) -> None:
        self._check_append(key, value, step.counts)
        counts, lengths = step.counts, self.lengths
        B, H, n, _ = key.shape
        i = torch.arange(n, device=key.device)
        pos = lengths[:, None] + i[None, :]
        if counts is not None:
            pos = torch.where(i[None, :] < counts[:, None], pos, self.max_seq_len)
        pos = pos.clamp(max=self.max_seq_len)
        # index_put_, not scatter_: Inductor functionalizes a scatter_ into a buffer as two full-cache
        # copies per layer per step, while index_put_ is re-inplaced to write only the new rows.
        idx = (torch.arange(B, device=key.device)[:, None, None], torch.arange(H, device=key.device)[None, :, None],
               pos[:, None, :])
        self.k.index_put_(idx, key)
        self.v.index_put_(idx, value)
        lengths += n if counts is None else counts

    def attend(self, query: torch.Tensor, step: Step = DECODE, scale: Optional[float] = None) -> torch.Tensor:
        self._check_attend(query, step.counts)
        lengths, q = self.lengths, query.shape[2]
        counts = torch.full_like(lengths, q) if step.counts is None else step.counts
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]
        t = torch.arange(self.max_seq_len + 1, device=query.device)
        visible = t[None, None, :] <= pos[:, :, None]
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(query, self.k, self.v, attn_mask=visible[:, None], scale=scale,
                                              enable_gqa=True)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, max length, head_dim] as stored."""
        n = int(self.lengths.max())
        return self.k[:, :, :n], self.v[:, :, :n]
