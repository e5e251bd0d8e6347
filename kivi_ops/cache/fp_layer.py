"""FPLayer: the unquantized static-cache baseline, with KIVILayer's interface.

Same append/attend contract (per-row lengths as device tensors, right-padded rows with
Step.counts, causal q_len > 1), so the generation loop and the attention module do not care which
layer they hold. Plain PyTorch: it compiles, exports and graph-captures as is.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .layer import CacheLayer
from .step import DECODE, Step


class FPLayer(CacheLayer):
    """Keys and values [B, H, S + 1, D] and lengths [B]. The spare row past max_seq_len takes the
    writes of padding tokens, which are never read."""

    def __init__(self, *, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device)
        shape = (batch_size, num_kv_heads, max_seq_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def nbytes(self) -> int:
        """Bytes of the K/V rows a sequence can use (neither the spare padding row nor lengths)."""
        return 2 * self.batch_size * self.num_kv_heads * self.head_dim * self.k.element_size() * self.max_seq_len

    def reset(self) -> None:
        for buf in (self.k, self.v, self.lengths):
            buf.zero_()

    def append(self, key: torch.Tensor, value: torch.Tensor, step: Step = DECODE) -> None:
        self._check_append(key, value, step.counts)
        counts, lengths = step.counts, self.lengths
        B, H, n, _ = key.shape
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
        self.k.index_put_(idx, key)
        self.v.index_put_(idx, value)
        lengths += n if counts is None else counts

    def attend(self, query: torch.Tensor, step: Step = DECODE, scale: Optional[float] = None) -> torch.Tensor:
        self._check_attend(query, step.counts)
        lengths, q = self.lengths, query.shape[2]
        counts = torch.full_like(lengths, q) if step.counts is None else step.counts
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]  # [B, q]
        t = torch.arange(self.max_seq_len + 1, device=query.device)
        visible = t[None, None, :] <= pos[:, :, None]  # [B, q, S+1]
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(query, self.k, self.v, attn_mask=visible[:, None], scale=scale,
                                              enable_gqa=True)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, max length, head_dim] as stored (KIVILayer's contract)."""
        n = int(self.lengths.max())
        return self.k[:, :, :n], self.v[:, :, :n]
