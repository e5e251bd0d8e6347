"""WindowLayer: the cache of a sliding-window attention layer (Mistral, Phi-3, Qwen2/3 with
use_sliding_window, Gemma 3's local layers), with KIVILayer's interface.

A query at position p attends to the keys at positions p - window < t <= p (transformers'
sliding-window mask), so a decode step needs the last `window` tokens only: they live in a ring of
`window` slots (position t in slot t % window), in full precision. The bytes stay fixed however
long the sequence grows; a KIVI-quantized ring would save little at the window sizes models use
(docs/cache.md, "Sliding-window layers").

Same contract as FPLayer (per-row lengths as device tensors, right-padded rows with Step.counts):
static shapes, masks computed from positions, plain PyTorch, so it compiles with fullgraph and
exports as is. A prompt is attended exactly by the model (KIVIAttention's prefill); the ring keeps
its last `window` tokens. An attend over several new tokens is exact only while the sequence fits
the window: once it has wrapped, the appended tokens overwrote keys the earlier queries needed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .layer import CacheLayer
from .step import DECODE, Step


class WindowLayer(CacheLayer):
    """Keys and values [B, H, slots + 1, D], slots = min(window, max_seq_len), and lengths [B]
    (tokens seen: the position of the next token, not the tokens held). The spare slot takes the
    writes of padding tokens and of prompt tokens already out of the window; it is never visible."""

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
        """Bytes of the K/V slots a sequence can use (neither the spare slot nor lengths)."""
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
        # The last `slots` real tokens of each row land in their ring slots; the rest (pads, and
        # prompt tokens already out of the window) on the spare slot. Distinct positions within
        # `slots` of each other get distinct slots, so no two kept tokens collide.
        keep = (i < real[:, None]) & (i >= real[:, None] - self.slots)
        slot = torch.where(keep, (lengths[:, None] + i) % self.slots, self.slots)  # [B, n]
        # index_put_ on (batch, head, slot) rows: see FPLayer.append (Inductor re-inplaces it).
        idx = (torch.arange(B, device=key.device)[:, None, None], torch.arange(H, device=key.device)[None, :, None],
               slot[:, None, :])
        self.window_k.index_put_(idx, key)
        self.window_v.index_put_(idx, value)
        lengths += real

    def _check_attend_window(self, q: int, counts: Optional[torch.Tensor]) -> None:
        """Eagerly refuse what the ring cannot answer exactly: several new tokens on a sequence
        that has passed the window (their earlier queries' keys were overwritten)."""
        if torch.compiler.is_compiling() or q == 1:  # traced: no check (nor a guard on q)
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
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]  # [B, q]
        slot = torch.arange(self.slots + 1, device=query.device)
        last = (lengths - 1)[:, None]
        held = last - (last - slot[None, :]) % self.slots  # [B, slots + 1]: the position in each slot
        valid = (held >= 0) & (slot < self.slots)[None, :]
        held, pos = held[:, None, :], pos[:, :, None]
        visible = valid[:, None, :] & (held <= pos) & (held > pos - self.window)  # [B, q, slots + 1]
        # A query that sees nothing (a padding query, an empty server row) sees every slot instead:
        # its output is never used, and a fully masked row is NaN on some SDPA backends (torch
        # 2.13's CPU kernels return zeros, which the tests cannot tell apart).
        visible = visible | ~visible.any(dim=-1, keepdim=True)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(query, self.window_k, self.window_v, attn_mask=visible[:, None],
                                              scale=scale, enable_gqa=True)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, held, head_dim] of the tokens held, oldest first
        (held = min(longest length, slots); shorter rows are padded at the end with zeros)."""
        held = int(min(int(self.lengths.max()), self.slots))
        last = self.lengths - 1
        t = torch.arange(held, device=self.device)
        first = (last + 1 - torch.clamp(last + 1, max=self.slots))[:, None]  # oldest position held, per row
        position = first + t[None, :]
        slot = torch.where(position <= last[:, None], position % self.slots, self.slots)  # [B, held]
        index = slot[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
        spare_zero = (slot < self.slots)[:, None, :, None]
        return (torch.where(spare_zero, self.window_k.gather(2, index), 0),
                torch.where(spare_zero, self.window_v.gather(2, index), 0))
