"""The static caches: a list of per-layer objects (layer.py), as in transformers' cache_utils.

`KIVICache` (quantized) and `FPCache` (the unquantized baseline) are both an `nn.Module` (their
layers' buffers are its state: `.to()`, `state()`, torch.export) and a transformers `Cache` (pass
one to `model.generate(past_key_values=...)` of a patched model). Everything a layer does, it does
itself: `cache.layers[i].append(key, value, step)` and `.attend(query, step)`. The cache only
builds the layers and handles what spans them: byte accounting, reset, the state an exported
program carries, and copying one sequence between caches.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache

from .. import ops  # noqa: F401  registers torch.ops.kivi, which the layers' ops call
from ..config import KIVIConfig
from .fp_layer import FPLayer
from .layer import CacheLayer, KIVILayer
from .window_layer import WindowLayer


def fp16_cache_nbytes(*, num_layers: int, batch_size: int, num_tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of an unquantized fp16 K+V cache holding num_tokens tokens per sequence."""
    return 2 * num_layers * batch_size * num_kv_heads * num_tokens * head_dim * 2


def cache_capacity(state_shapes: Mapping[str, Sequence[int]]) -> Optional[tuple[int, int, str]]:
    """(batch_size, max_seq_len, the buffer read) of a cache from its state buffers' static shapes
    by state name (StaticCacheBase.state(); what an exported program records), or None when they
    are not a cache's. KIVI's k_codes is [B, H, S, D / codes per byte], FPLayer's k [B, H, S + 1, D];
    the first full-attention layer is read (a WindowLayer holds only its window)."""
    layers = sorted({int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").match, state_shapes) if m})
    for name, spare in ((f"layers.{i}.{buf}", spare) for i in layers for buf, spare in (("k_codes", 0), ("k", 1))):
        shape = state_shapes.get(name)
        if shape is None:
            continue
        if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"cache tensor {name} has shape {list(shape)}; expected 4 static dims")
        return shape[0], shape[2] - spare, name
    return None


def _check_num_layers(num_layers) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")


def _build_layers(windows: Optional[Sequence[Optional[int]]], num_layers: int, full_layer, **dims) -> list[CacheLayer]:
    """One layer per model layer: full_layer(i) for full attention, a WindowLayer where windows[i]
    is a sliding window (tokens). windows None: every layer attends fully."""
    _check_num_layers(num_layers)
    windows = [None] * num_layers if windows is None else list(windows)
    if len(windows) != num_layers or not all(w is None or (isinstance(w, int) and w > 0) for w in windows):
        raise ValueError(f"windows must hold one entry per layer ({num_layers}), each None (full attention) or a "
                         f"positive int (a sliding window in tokens), got {windows!r}")
    return [full_layer(i) if w is None else WindowLayer(window=w, **dims) for i, w in enumerate(windows)]


class StaticCacheBase(nn.Module, Cache):
    """What both caches share. Dimensions are the layers' (all alike; a WindowLayer's max_seq_len
    is the sequence's, its buffers hold only its window)."""

    def __init__(self, layers: list[CacheLayer]):
        nn.Module.__init__(self)
        Cache.__init__(self, layers=nn.ModuleList(layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def max_seq_len(self) -> int:
        return self.layers[0].max_seq_len

    @property
    def max_cache_len(self) -> int:
        return self.max_seq_len

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def lengths(self) -> torch.Tensor:
        """Tokens stored per sequence (a device tensor, the same in every layer; no sync)."""
        return self.layers[0].lengths

    def reset(self) -> None:
        """Empty every sequence (constants stay)."""
        for layer in self.layers:
            layer.reset()

    def restart_rows(self, fresh: torch.Tensor) -> None:
        """Rows where fresh [B] is True start new sequences (inside a graph: no host sync)."""
        for layer in self.layers:
            layer.restart_rows(fresh)

    def constants(self) -> list[torch.Tensor]:
        """Buffers that hold constants, not sequence state (nuq levels, RoPE frequencies)."""
        return [t for layer in self.layers for t in layer.constants()]

    def state(self) -> dict[str, torch.Tensor]:
        """The sequence state by buffer name: what an exported program without mutable state
        (ONNX) takes in and gives back each call. Constants stay inside the program."""
        constants = {id(t) for t in self.constants()}
        return {name: t for name, t in self.named_buffers() if id(t) not in constants}

    def load_row(self, row: int, source: "StaticCacheBase", source_row: int = 0) -> None:
        """Make sequence `row` a copy of `source`'s sequence `source_row` (a cache of the same kind
        and settings, any batch size): every state buffer is batch-first. The other rows are
        untouched. A server prefills a request in a batch-1 cache and loads it into a free row, so
        an admission costs the prompt alone, not a forward over every row."""
        mine, theirs = self.state(), source.state()
        if mine.keys() != theirs.keys():
            raise ValueError("load_row needs a cache of the same kind and options")
        for name, t in mine.items():
            src = theirs[name]
            if t.shape[1:] != src.shape[1:]:
                raise ValueError(f"load_row: {name} has shape {list(src.shape)}, this cache {list(t.shape)}")
            t[row].copy_(src[source_row])

    # ---------------------------------------------------------------- transformers' row API (beam search)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row b becomes a copy of row beam_idx[b], in every layer (transformers' beam search calls
        this after each step). Every per-row state buffer follows: KIVI's codes, scales, zeros,
        residuals, lengths, token pools and sparse stores alike (each layer's row_tensors()). The
        buffers are written in place (copy_), never replaced, so a compiled step or a CUDA graph
        that holds their addresses reads the reordered rows. A paged cache is refused: its rows
        own pages through a block table, and two beams sharing a row's pages would write into each
        other's tokens."""
        if any(layer.page_tensors() for layer in self.layers):
            raise ValueError(f"{type(self).__name__} cannot reorder rows for beam search (num_beams > 1): its rows "
                             "share a page pool; use num_beams=1, or a static cache (kivi_models.make_cache)")
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.shape != (self.batch_size,) \
                or beam_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"beam_idx must be an integer tensor of shape [{self.batch_size}] (one source row per "
                             f"row), got {getattr(beam_idx, 'dtype', type(beam_idx).__name__)} "
                             f"{list(getattr(beam_idx, 'shape', []))}")
        idx = beam_idx.to(self.device, torch.int64)
        for layer in self.layers:
            for t in layer.row_tensors().values():
                t.copy_(t.index_select(0, idx))  # index_select makes a new tensor: no aliasing on overlap

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(self._fixed_batch_why("batch_repeat_interleave"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError(self._fixed_batch_why("batch_select_indices"))

    def _fixed_batch_why(self, what: str) -> str:
        return (f"{type(self).__name__}.{what}: a static cache holds a fixed batch_size ({self.batch_size} rows) "
                "and cannot grow or shrink; build it with batch_size = prompts x num_beams (or x num_return_sequences)")

    def nbytes(self) -> int:
        """Exact bytes held, all layers (each layer's nbytes())."""
        return sum(layer.nbytes() for layer in self.layers)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Exact bytes held per layer kind: {"full": ..., "window": ...} (layers of that kind summed)."""
        kinds = {"full": 0, "window": 0}
        for layer in self.layers:
            kinds["window" if layer.is_sliding else "full"] += layer.nbytes()
        return kinds

    def fp16_nbytes(self, num_tokens: Optional[int] = None) -> int:
        """Bytes an fp16 K+V cache would need for num_tokens (default max_seq_len) per sequence;
        a sliding-window layer's needs at most its window."""
        tokens = self.max_seq_len if num_tokens is None else num_tokens
        return sum(fp16_cache_nbytes(num_layers=1, batch_size=self.batch_size,
                                     num_tokens=min(tokens, getattr(layer, "window", tokens)),
                                     num_kv_heads=self.num_kv_heads, head_dim=self.head_dim) for layer in self.layers)


class KIVICache(StaticCacheBase):
    """A preallocated, static-shape KV cache stored the KIVI way: one KIVILayer per model layer.

    rope_inv_freq / rope_scaling: the model's RoPE frequencies [head_dim / 2] and
    attention_scaling (rope.model_rope_frequencies), required when config.pre_rope. portable:
    for exporters that cannot carry custom ops (ONNX, ExecuTorch; dispatch.py). windows: per
    layer, None (full attention: a KIVILayer) or a sliding window in tokens (a WindowLayer)."""

    def __init__(self, config: KIVIConfig, *, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 rope_inv_freq: Optional[torch.Tensor] = None, rope_scaling: float = 1.0, portable: bool = False,
                 windows: Optional[Sequence[Optional[int]]] = None):
        if not isinstance(config, KIVIConfig):
            raise TypeError(f"config must be a KIVIConfig, got {type(config).__name__}")
        _check_num_layers(num_layers)
        if config.outlier_tokens and config.outlier_skip_layers >= num_layers:
            raise ValueError(
                f"outlier_tokens={config.outlier_tokens} would apply to no layer: outlier_skip_layers="
                f"{config.outlier_skip_layers} skips all {num_layers} (lower it or set outlier_tokens=0)"
            )
        config.check_num_layers(num_layers)
        rope = None if rope_inv_freq is None else (rope_inv_freq, rope_scaling)
        dims = dict(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=dtype, device=device)
        super().__init__(_build_layers(windows, num_layers,
                                       lambda i: KIVILayer(config, i, **dims, rope=rope, portable=portable), **dims))
        self.config = config


class FPCache(StaticCacheBase):
    """The unquantized baseline: one FPLayer per model layer (a WindowLayer per sliding-window
    layer, as in KIVICache)."""

    def __init__(self, *, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 windows: Optional[Sequence[Optional[int]]] = None):
        dims = dict(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=dtype, device=device)
        super().__init__(_build_layers(windows, num_layers, lambda i: FPLayer(**dims), **dims))
