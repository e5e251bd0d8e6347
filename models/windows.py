"""Which layers attend over a sliding window, and how wide, by transformers' rule: per attention
module when it carries `sliding_window` (Qwen2/3, Gemma 3), else `config.sliding_window` for all."""

from __future__ import annotations

from typing import Optional

_UNSET = object()


def attention_window(attention, config) -> Optional[int]:
    """The sliding window of one attention module (transformers' or KIVIAttention), None for full attention."""
    window = getattr(attention, "sliding_window", _UNSET)
    return getattr(config, "sliding_window", None) if window is _UNSET else window


def layer_windows(model) -> list[Optional[int]]:
    """Per decoder layer: its sliding window in tokens, or None (full attention)."""
    return [attention_window(layer.self_attn, model.config) for layer in model.model.layers]
