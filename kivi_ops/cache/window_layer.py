"""The cache of a sliding-window attention layer: a full-precision ring of `window` slots (position
t in slot t % window), KIVILayer's interface (docs/cache.md, "Sliding-window layers"). A multi-token
attend is exact only until the sequence wraps the window."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .layer import CacheLayer
from .step import DECODE, Step


class WindowLayer(CacheLayer):
    """Ring [B, H, slots + 1, D]; lengths count tokens seen. The spare slot takes padding and
    out-of-window writes and is never visible."""

    is_sliding = True

    def __init__(self, *, window: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device)
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int (the sliding window in tokens), got {window!r}")
        self.window = window
        self.slots = min(window, max_seq_len)
        shape = (batch_size, num_kv_heads, self.slots + 1, head_dim)
        self.register_buffer("window_k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("window_v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def nbytes(self) -> int:
        return 2 * self.batch_size * self.num_kv_heads * self.head_dim * self.window_k.element_size() * self.slots

    def reset(self) -> None:
        for buf in (self.window_k, self.window_v, self.lengths):
            buf.zero_()

    def append(self, key: torch.Tensor, value: torch.Tensor, step: Step = DECODE) -> None:
        self._check_append(key, value, step.counts)
        counts, lengths = step.counts, self.lengths
        B, H, n, _ = key.shape
        i = torch.arange(n, device=key.device)[None, :]
        real = torch.full_like(lengths, n) if counts is None else counts
        # The last `slots` real tokens go to their ring slots (distinct within `slots`, so no collision),
        # the rest to the spare slot.
        keep = (i < real[:, None]) & (i >= real[:, None] - self.slots)
        slot = torch.where(keep, (lengths[:, None] + i) % self.slots, self.slots)
        idx = (torch.arange(B, device=key.device)[:, None, None], torch.arange(H, device=key.device)[None, :, None],
               slot[:, None, :])
        self.window_k.index_put_(idx, key)
        self.window_v.index_put_(idx, value)
        lengths += real

    def _check_attend_window(self, q: int, counts: Optional[torch.Tensor]) -> None:
        """Eagerly refuse several new tokens on a wrapped sequence (their earlier queries' keys are gone)."""
        if torch.compiler.is_compiling() or q == 1:  # traced: no check, and no guard on q
            return
        new = torch.full_like(self.lengths, q) if counts is None else counts
        wrapped = (self.lengths > self.slots) & (new > 1)
        if bool(wrapped.any()):
            raise ValueError(
                f"a {q}-token attention step on a sliding-window layer (window {self.window}) whose sequence "
                f"holds {int(self.lengths.max())} tokens: the new tokens overwrote keys their earlier queries "
                "need. Prompts are attended exactly (prefill) and decode steps take one token at a time")

    def attend(self, query: torch.Tensor, step: Step = DECODE, scale: Optional[float] = None) -> torch.Tensor:
        self._check_attend(query, step.counts)
        q = query.shape[2]
        self._check_attend_window(q, step.counts)
        lengths = self.lengths
        counts = torch.full_like(lengths, q) if step.counts is None else step.counts
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]
        slot = torch.arange(self.slots + 1, device=query.device)
        last = (lengths - 1)[:, None]
        held = last - (last - slot[None, :]) % self.slots
        valid = (held >= 0) & (slot < self.slots)[None, :]
        held, pos = held[:, None, :], pos[:, :, None]
        visible = valid[:, None, :] & (held <= pos) & (held > pos - self.window)
        # A query that sees nothing sees every slot instead: its output is unused, and a fully masked
        # row is NaN on some SDPA backends.
        visible = visible | ~visible.any(dim=-1, keepdim=True)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(query, self.window_k, self.window_v, attn_mask=visible[:, None],
                                              scale=scale, enable_gqa=True)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of the tokens held, oldest first, zero-padded at the end."""
        held = int(min(int(self.lengths.max()), self.slots))
        last = self.lengths - 1
        t = torch.arange(held, device=self.device)
        first = (last + 1 - torch.clamp(last + 1, max=self.slots))[:, None]
        position = first + t[None, :]
        slot = torch.where(position <= last[:, None], position % self.slots, self.slots)
        index = slot[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
        spare_zero = (slot < self.slots)[:, None, :, None]
        return (torch.where(spare_zero, self.window_k.gather(2, index), 0),
                torch.where(spare_zero, self.window_v.gather(2, index), 0))
