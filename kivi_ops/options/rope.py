"""Rotary position embedding (Llama's rotate-half form) and its inverse, for KVQuant's pre-RoPE keys."""

from __future__ import annotations

from typing import Optional

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def model_rope_tables(model, length: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face Llama-family model's own RoPE cos/sin for positions 0..length-1, [1, 1, length, D]."""
    positions = torch.arange(length, device=model.device)[None]
    probe = torch.zeros(1, length, 1, device=model.device, dtype=model.dtype)
    rotary = model.model.rotary_emb
    cos, sin = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    return cos[:, None], sin[:, None]


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's inverse; divides by cos^2 + sin^2, not 1 when the variant scales its tables."""
    return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)


def rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] fp32 rotated to positions with inv_freq [D/2], as transformers computes it
    (angle = position * inv_freq in fp32); attention_scaling is folded into the softmax scale."""
    angle = positions.to(torch.float32)[..., None] * inv_freq.float()
    angle = torch.cat([angle, angle], dim=-1)
    return x * torch.cos(angle) + _rotate_half(x) * torch.sin(angle)


def model_rope_frequencies(model) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, attention_scaling) of a Llama-family model's RoPE (the full-attention
    table of a per-layer-type model); length-dependent variants (dynamic NTK, longrope) are refused."""
    rotary = model.model.rotary_emb
    prefix = "full_attention_" if hasattr(rotary, "layer_types") else ""
    rope_type = getattr(rotary, "rope_type", "default")
    rope_type = rope_type["full_attention"] if isinstance(rope_type, dict) else rope_type
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(f"pre_rope needs RoPE frequencies that do not depend on the sequence length; "
                         f"this model's rope_type is {rope_type!r}")
    return (getattr(rotary, f"{prefix}inv_freq").detach().float().clone(),
            float(getattr(rotary, f"{prefix}attention_scaling", 1.0)))
