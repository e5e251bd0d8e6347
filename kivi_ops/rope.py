"""Rotary position embedding (Llama's rotate-half form) and its inverse, for KVQuant's pre-RoPE key
quantization (paper 004, Section 3.2): keys are quantized before RoPE, where each channel keeps
its own magnitude, and rotated after dequantization. RoPE mixes channel pairs (i, i + D/2) with a
position-dependent angle, which smears outlier channels across their partners post-RoPE."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by the angles whose cos/sin are given (broadcastable to x)."""
    return x * cos + _rotate_half(x) * sin


def model_rope_tables(model, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face Llama-family model's own RoPE cos/sin for positions 0..length-1, shaped
    [1, 1, length, head_dim] to broadcast over [batch, heads, tokens, head_dim]."""
    positions = torch.arange(length, device=model.device)[None]
    probe = torch.zeros(1, length, 1, device=model.device, dtype=model.dtype)
    cos, sin = model.model.rotary_emb(probe, positions)
    return cos[:, None], sin[:, None]


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse: undo_rope(apply_rope(x, cos, sin), cos, sin) == x (up to rounding). Divides by
    cos^2 + sin^2, which is 1 unless the RoPE variant scales its tables (attention_scaling)."""
    return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)
