"""The static caches, KIVICache and FPCache: an nn.Module and a transformers Cache over a list of
per-layer objects (layer.py). The cache builds the layers and handles what spans them: bytes,
reset, exported state, copying a sequence between caches, beam reorder."""

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
    return 2 * num_layers * batch_size * num_kv_heads * num_tokens * head_dim * 2


def cache_capacity(state_shapes: Mapping[str, Sequence[int]]) -> Optional[tuple[int, int, str]]:
    """(batch_size, max_seq_len, buffer read) from a cache's state shapes by name, or None when not a
    cache's; reads the first full-attention layer (KIVI k_codes [B, H, S, .], FPLayer k [B, H, S + 1, D])."""
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
    _check_num_layers(num_layers)
    windows = [None] * num_layers if windows is None else list(windows)
    if len(windows) != num_layers or not all(w is None or (isinstance(w, int) and w > 0) for w in windows):
        raise ValueError(f"windows must hold one entry per layer ({num_layers}), each None (full attention) or a "
                         f"positive int (a sliding window in tokens), got {windows!r}")
    return [full_layer(i) if w is None else WindowLayer(window=w, **dims) for i, w in enumerate(windows)]


class StaticCacheBase(nn.Module, Cache):
    """What both caches share; a WindowLayer's max_seq_len is the sequence's, its buffers only its window."""

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
        """Tokens stored per sequence (a device tensor; no sync)."""
        return self.layers[0].lengths

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def restart_rows(self, fresh: torch.Tensor) -> None:
        for layer in self.layers:
            layer.restart_rows(fresh)

    def constants(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.constants()]

    def state(self) -> dict[str, torch.Tensor]:
        """The sequence state by buffer name: what an exported program without mutable state (ONNX) takes
        and gives back each call."""
        constants = {id(t) for t in self.constants()}
        return {name: t for name, t in self.named_buffers() if id(t) not in constants}

    def load_row(self, row: int, source: "StaticCacheBase", source_row: int = 0) -> None:
        """Make sequence `row` a copy of a same-kind cache's `source_row` (any batch size); other rows stay.
        A server prefills a request in a batch-1 cache and loads it into a free row."""
        mine, theirs = self.state(), source.state()
        if mine.keys() != theirs.keys():
            raise ValueError("load_row needs a cache of the same kind and options")
        for name, t in mine.items():
            src = theirs[name]
            if t.shape[1:] != src.shape[1:]:
                raise ValueError(f"load_row: {name} has shape {list(src.shape)}, this cache {list(t.shape)}")
            t[row].copy_(src[source_row])


    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row b becomes a copy of row beam_idx[b] in every layer. Written in place (copy_), so a compiled
        step or CUDA graph holding the addresses reads the reordered rows; paged caches are refused (beams
        would write into each other's shared pages)."""
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
                t.copy_(t.index_select(0, idx))  # a new tensor: no aliasing between overlapping rows

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(self._fixed_batch_why("batch_repeat_interleave"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError(self._fixed_batch_why("batch_select_indices"))

    def _fixed_batch_why(self, what: str) -> str:
        return (f"{type(self).__name__}.{what}: a static cache holds a fixed batch_size ({self.batch_size} rows) "
                "and cannot grow or shrink; build it with batch_size = prompts x num_beams (or x num_return_sequences)")

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def nbytes_by_kind(self) -> dict[str, int]:
        kinds = {"full": 0, "window": 0}
        for layer in self.layers:
            kinds["window" if layer.is_sliding else "full"] += layer.nbytes()
        return kinds

    def fp16_nbytes(self, num_tokens: Optional[int] = None) -> int:
        """Bytes an fp16 K+V cache would need for num_tokens (default max_seq_len), windows capped."""
        tokens = self.max_seq_len if num_tokens is None else num_tokens
        return sum(fp16_cache_nbytes(num_layers=1, batch_size=self.batch_size,
                                     num_tokens=min(tokens, getattr(layer, "window", tokens)),
                                     num_kv_heads=self.num_kv_heads, head_dim=self.head_dim) for layer in self.layers)


class KIVICache(StaticCacheBase):
    """A preallocated, static-shape KV cache stored the KIVI way. rope_inv_freq / rope_scaling: required
    with pre_rope; windows: per layer None (full attention) or a sliding window in tokens."""

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
    """The unquantized baseline: one FPLayer per model layer (WindowLayers as in KIVICache)."""

    def __init__(self, *, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 windows: Optional[Sequence[Optional[int]]] = None):
        dims = dict(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=dtype, device=device)
        super().__init__(_build_layers(windows, num_layers, lambda i: FPLayer(**dims), **dims))
