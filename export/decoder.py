"""The KIVI decoder as one exportable module: model weights + static cache + one forward.

    forward(input_ids [B, n], input_pos [B], counts [B]) -> logits [B, vocab]

Row b holds counts[b] real tokens (right padding) that start at position input_pos[b]; the
result is the logits of each row's last real token. A row whose input_pos is 0 starts a new
sequence (its cache length is reset in the graph, its sink / outlier pools emptied). When every
row starts fresh, the layers attend over the exact prompt keys/values (as `kivi generate`'s
prefill does); otherwise over the cache (decode steps, or a prompt continued in chunks). Both
paths are branches of one `torch.cond`, so a single program with a dynamic token count serves prompts and decode steps.

The cache lives in the module's buffers (`torch.export` records their in-place updates), or,
with `cache_as_io=True` for formats without mutable state (ONNX), comes in as extra inputs and
goes out as extra outputs: forward(input_ids, input_pos, counts, *cache) -> (logits, *cache).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kivi_models.hf_cache import KIVIHFCache
from kivi_ops.cache import is_constant_buffer


class ExportableDecoder(nn.Module):
    def __init__(self, model: nn.Module, cache: KIVIHFCache, *, cache_as_io: bool = False):
        super().__init__()
        self.model = model
        self.cache = cache.backing
        self.cache_as_io = cache_as_io
        # The cache's state; constants (nuq levels, RoPE frequencies) stay in the program.
        self.cache_names = [name for name, _ in self.cache.named_buffers() if not is_constant_buffer(name)]

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self.cache, name) for name in self.cache_names)

    def _cache_over(self, tensors) -> nn.Module:
        """A shallow copy of the cache module whose buffers are `tensors` (the module's own
        buffers are left alone)."""
        if len(tensors) != len(self.cache_names):
            raise ValueError(f"expected {len(self.cache_names)} cache tensors, got {len(tensors)}")
        view = copy.copy(self.cache)
        view._buffers = {**self.cache._buffers, **dict(zip(self.cache_names, tensors))}
        return view

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor, counts: torch.Tensor, *cache_in):
        backing = self._cache_over([t.clone() for t in cache_in]) if self.cache_as_io else self.cache
        fresh = input_pos == 0
        for layer in range(backing.num_layers):
            lengths = backing.lengths(layer)
            lengths.copy_(torch.where(fresh, torch.zeros_like(lengths), lengths))
            pool = backing.pool_buffers(layer) if hasattr(backing, "pool_buffers") else ()
            if pool:  # sink / outlier pools: a fresh row's slots are empty again
                pool[2].copy_(torch.where(fresh[:, None, None], torch.full_like(pool[2], -1), pool[2]))
        hf_cache = KIVIHFCache(backing)
        hf_cache.exact_attention = fresh.all()
        n = input_ids.shape[1]
        positions = input_pos[:, None] + torch.arange(n, device=input_ids.device)[None, :]
        hidden = self.model.model(input_ids=input_ids, position_ids=positions, past_key_values=hf_cache,
                                  use_cache=True, kivi_counts=counts).last_hidden_state
        last = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), counts - 1]
        logits = self.model.lm_head(last)
        if self.cache_as_io:
            return (logits, *(getattr(backing, name) for name in self.cache_names))
        return logits
