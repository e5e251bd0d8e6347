"""The KIVI decoder as one exportable module: model weights + static cache + one forward.

    forward(input_ids [B, n], input_pos [B], counts [B]) -> logits [B, vocab]

Row b holds counts[b] real tokens (right padding) that start at position input_pos[b]; the
result is the logits of each row's last real token. A row whose input_pos is 0 starts a new
sequence (the cache restarts that row in the graph: length 0, sink / outlier pools emptied).
When every row starts fresh, the layers attend over the exact prompt keys/values (as `kivi
generate`'s prefill does); otherwise over the cache (decode steps, or a prompt continued in
chunks). Both paths are computed and `torch.where` picks one (models/attention.py says why not
torch.cond), so a single program with a dynamic token count serves prompts and decode steps.

The cache lives in the module's buffers (`torch.export` records their in-place updates), or,
with `cache_as_io=True` for formats without mutable state (ONNX), comes in as extra inputs and
goes out as extra outputs: forward(input_ids, input_pos, counts, *cache) -> (logits, *cache).
The cache's constants (nuq levels, RoPE frequencies) stay inside the program either way.
"""

from __future__ import annotations

import torch
from torch import nn

from kivi_models.generate import forward, lm_logits
from kivi_ops import StaticCacheBase, Step


class DecoderStep(nn.Module):
    """One call of the decoder over the cache it holds (its buffers are the state)."""

    def __init__(self, model: nn.Module, cache: StaticCacheBase):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        fresh = input_pos == 0
        self.cache.restart_rows(fresh)
        n = input_ids.shape[1]
        positions = input_pos[:, None] + torch.arange(n, device=input_ids.device)[None, :]
        hidden = forward(self.model, self.cache, input_ids, positions, Step(counts=counts, exact=fresh.all()))
        last = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), counts - 1]
        return lm_logits(self.model, last)  # with the family's final logit soft-capping, as `kivi generate`


class ExportableDecoder(nn.Module):
    def __init__(self, model: nn.Module, cache: StaticCacheBase, *, cache_as_io: bool = False):
        super().__init__()
        self.step = DecoderStep(model, cache)
        self.cache_as_io = cache_as_io
        self.cache_names = list(cache.state())

    @property
    def cache(self) -> nn.Module:
        return self.step.cache

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        state = self.cache.state()
        return tuple(state[name] for name in self.cache_names)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor, counts: torch.Tensor, *cache_in):
        if not self.cache_as_io:
            return self.step(input_ids, input_pos, counts)
        if len(cache_in) != len(self.cache_names):
            raise ValueError(f"expected {len(self.cache_names)} cache tensors, got {len(cache_in)}")
        # The step runs over copies of the given state (the module's own buffers stay as they are).
        state = {f"cache.{name}": t.clone() for name, t in zip(self.cache_names, cache_in)}
        logits = torch.func.functional_call(self.step, state, (input_ids, input_pos, counts))
        return (logits, *state.values())
