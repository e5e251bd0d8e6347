"""Rotary position embedding (Llama's rotate-half form) and its inverse, for KVQuant's pre-RoPE key
quantization (the KVQuant paper, Section 3.2): keys are quantized before RoPE, where each channel keeps
its own magnitude, and rotated after dequantization. RoPE mixes channel pairs (i, i + D/2) with a
position-dependent angle, which smears outlier channels across their partners post-RoPE."""

from __future__ import annotations

from typing import Optional

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by the angles whose cos/sin are given (broadcastable to x)."""
    return x * cos + _rotate_half(x) * sin


def model_rope_tables(model, length: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face Llama-family model's own RoPE cos/sin for positions 0..length-1, shaped
    [1, 1, length, head_dim] to broadcast over [batch, heads, tokens, head_dim]. layer_type: for a
    model with one table per layer type (Gemma 3: config.layer_types), which one."""
    positions = torch.arange(length, device=model.device)[None]
    probe = torch.zeros(1, length, 1, device=model.device, dtype=model.dtype)
    rotary = model.model.rotary_emb
    cos, sin = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    return cos[:, None], sin[:, None]


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse: undo_rope(apply_rope(x, cos, sin), cos, sin) == x (up to rounding). Divides by
    cos^2 + sin^2, which is 1 unless the RoPE variant scales its tables (attention_scaling)."""
    return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)


def rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] (fp32) rotated to its positions [..., T] (broadcastable) with the frequencies
    inv_freq [D/2], computed as transformers does: angle = position * inv_freq in fp32, both
    halves. The cache's pre-RoPE keys (KVQuant) are rotated this way after dequantization; the
    model's attention_scaling, if any, is folded into the softmax scale by the cache."""
    angle = positions.to(torch.float32)[..., None] * inv_freq.float()
    angle = torch.cat([angle, angle], dim=-1)
    return x * torch.cos(angle) + _rotate_half(x) * torch.sin(angle)


def model_rope_frequencies(model) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention_scaling) of a Hugging Face Llama-family model's RoPE,
    for a cache that rotates pre-RoPE keys itself. Variants whose frequencies change with the
    sequence length (dynamic NTK, longrope) cannot be applied at a fixed table and are refused.
    A model with one table per layer type (Gemma 3) gives its full-attention table: only
    full-attention layers hold KIVI layers (sliding-window layers keep exact keys)."""
    rotary = model.model.rotary_emb
    prefix = "full_attention_" if hasattr(rotary, "layer_types") else ""
    rope_type = getattr(rotary, "rope_type", "default")
    rope_type = rope_type["full_attention"] if isinstance(rope_type, dict) else rope_type
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(f"pre_rope needs RoPE frequencies that do not depend on the sequence length; "
                         f"this model's rope_type is {rope_type!r}")
    return (getattr(rotary, f"{prefix}inv_freq").detach().float().clone(),
            float(getattr(rotary, f"{prefix}attention_scaling", 1.0)))
