"""A transformers `Cache` backed by a static KIVICache (or the FPCache baseline).

The patched attention (attention.py) calls the backing cache's fused append/attend directly.
`update()` exists for code that calls the transformers cache API itself: it appends and returns
the keys/values as attention would see them (dequantized), a slow but correct path.
Sequence lengths come from the cache's length tensors, never from `keys.any()`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _StaticLayerView(CacheLayerMixin):
    """One layer of the backing cache, as transformers' per-layer cache API sees it."""

    is_compileable = False  # generate() must not auto-compile around our own compiled loop
    is_sliding = False

    def __init__(self, owner: "KIVIHFCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner.append(self.layer_idx, key_states, value_states)
        return self.owner.backing.dequantized(self.layer_idx)

    def get_seq_length(self) -> int:
        return int(self.owner.backing.lengths(self.layer_idx).max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.backing.max_seq_len

    def reset(self) -> None:
        pass  # the owner resets the backing cache once for all layers

    @property
    def batch_size(self) -> int:
        return self.owner.backing.batch_size


class KIVIHFCache(Cache):
    """`model.generate(..., past_key_values=KIVIHFCache(kivi_cache))` with a patched model."""

    def __init__(self, backing):
        self.backing = backing
        super().__init__(layers=[_StaticLayerView(self, i) for i in range(backing.num_layers)])
        # Python-side flag per layer: the first append of a sequence batch is the prefill, whose
        # attention uses the exact keys/values (KIVI Algorithm 1); set once, so compiled decode
        # steps see a constant.
        self.prefilled = [False] * backing.num_layers
        # Set only inside exported programs: a bool tensor, True when this call is the prompt of
        # fresh sequences (exact attention) rather than a step over what the cache holds.
        self.exact_attention = None
        # The attention layers append keys before RoPE when the backing cache stores them so.
        self.pre_rope = bool(getattr(getattr(backing, "config", None), "pre_rope", False))

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, counts=None) -> None:
        self.backing.append(layer_idx, key, value, counts)
        if not self.prefilled[layer_idx]:
            self.prefilled[layer_idx] = True

    def attend(self, layer_idx: int, query: torch.Tensor, scale: float, counts=None) -> torch.Tensor:
        return self.backing.attend(layer_idx, query, scale, counts)

    def reset(self) -> None:
        self.backing.reset()
        self.prefilled = [False] * self.backing.num_layers

    @property
    def max_cache_len(self) -> int:
        return self.backing.max_seq_len

    def nbytes(self) -> int:
        return self.backing.nbytes()
