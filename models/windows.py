"""Which layers attend over a sliding window, and how wide: what decides each cache layer's kind.

transformers decides it per family, and the KIVI attention and the cache follow the same rule:
- a family whose attention modules carry `sliding_window` (Qwen2, Qwen3, Gemma 3: set from
  `config.layer_types`, None on full-attention layers) uses it per layer;
- the others (Mistral, Phi-3) apply `config.sliding_window` to every layer when it is set.
The mask transformers builds for a window W lets a query at position p see keys at p - W < t <= p.
"""

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
