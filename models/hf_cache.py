"""A transformers `Cache` backed by a static KIVICache (or the FPCache baseline).

The patched attention (attention.py) calls the backing cache's fused append/attend directly.
`update()` exists for code that calls the transformers cache API itself: it appends and returns
the keys/values as attention would see them (dequantized), a slow but correct path.
Sequence lengths come from the cache's length tensors, never from `keys.any()`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class LayerCache(CacheLayerMixin):
    """One layer of the backing cache: what the patched attention of that layer appends to and
    attends over, and transformers' per-layer cache API (update, get_seq_length, ...).

    It holds the backing layer module itself, not an index: a compiled decoder-layer region
    (generate.compile_decode_step on CPU) receives this object and runs, unchanged, for every layer."""

    is_compileable = False  # generate() must not auto-compile around our own compiled loop
    is_sliding = False

    def __init__(self, owner: "KIVIHFCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.backing, self.backing_layer = owner.backing, owner.backing.layers[layer_idx]
        self.is_initialized = True
        # Python-side flag: the first append of a sequence batch is the prefill, whose attention
        # uses the exact keys/values (KIVI Algorithm 1); set once, so compiled decode steps see a
        # constant.
        self.prefilled = False

    def append(self, key: torch.Tensor, value: torch.Tensor, counts=None) -> None:
        self.backing.append_to(self.backing_layer, key, value, counts)
        if not self.prefilled:
            self.prefilled = True

    def attend(self, query: torch.Tensor, scale: float, counts=None) -> torch.Tensor:
        return self.backing.attend_to(self.backing_layer, query, scale, counts)

    @property
    def pre_rope(self) -> bool:
        return self.owner.pre_rope

    @property
    def exact_attention(self):
        return self.owner.exact_attention

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.append(key_states, value_states)
        return self.backing.dequantized(self.layer_idx)

    def get_seq_length(self) -> int:
        return int(self.backing_layer.lengths.max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.backing.max_seq_len

    def reset(self) -> None:
        self.prefilled = False  # the owner resets the backing cache once for all layers

    @property
    def batch_size(self) -> int:
        return self.backing.batch_size


class KIVIHFCache(Cache):
    """`model.generate(..., past_key_values=KIVIHFCache(kivi_cache))` with a patched model."""

    def __init__(self, backing):
        self.backing = backing
        super().__init__(layers=[LayerCache(self, i) for i in range(backing.num_layers)])
        # Set by the decoder's pre-hook for a left-padded prompt batch (attention.py): (order, counts).
        self.left_pad = None
        # Set only inside exported programs: a bool tensor, True when this call is the prompt of
        # fresh sequences (exact attention) rather than a step over what the cache holds.
        self.exact_attention = None
        # The attention layers append keys before RoPE when the backing cache stores them so.
        self.pre_rope = bool(getattr(getattr(backing, "config", None), "pre_rope", False))

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, counts=None) -> None:
        self.layers[layer_idx].append(key, value, counts)

    def attend(self, layer_idx: int, query: torch.Tensor, scale: float, counts=None) -> torch.Tensor:
        return self.layers[layer_idx].attend(query, scale, counts)

    @property
    def prefilled(self) -> list[bool]:
        return [layer.prefilled for layer in self.layers]

    def reset(self) -> None:
        self.backing.reset()
        for layer in self.layers:
            layer.reset()

    @property
    def max_cache_len(self) -> int:
        return self.backing.max_seq_len

    def nbytes(self) -> int:
        return self.backing.nbytes()
