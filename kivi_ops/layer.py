"""One layer of the KIVI cache as a module of named buffers; its optional parts are sub-modules
(None when their option is off). `tensors()` hands the layer to the ops as a LayerTensors bundle.

Each buffer is registered separately and passed whole to the ops: slices or shared storage would
make functionalization clone the whole cache every compiled step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .config import KIVIConfig
from .layout import LayerTensors, QuantParams
from .packing import codes_per_byte


def _zeros(shape, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class TokenPool(nn.Module):
    """The sink / OTT outlier token pool (pool.py): exact keys and values of P tokens and their
    positions (-1: empty slot)."""

    def __init__(self, B: int, H: int, P: int, D: int, dtype, device):
        super().__init__()
        self.register_buffer("k", _zeros((B, H, P, D), dtype, device), persistent=False)
        self.register_buffer("v", _zeros((B, H, P, D), dtype, device), persistent=False)
        self.register_buffer("pos", torch.full((B, H, P), -1, dtype=torch.int64, device=device), persistent=False)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.pos.fill_(-1)


class SparseStore(nn.Module):
    """KVQuant's dense-and-sparse outliers (extras.py): exact values and their int16 indices (-1: none)."""

    def __init__(self, k_shape, v_shape, dtype, device):
        super().__init__()
        self.register_buffer("k", _zeros(k_shape, dtype, device), persistent=False)
        self.register_buffer("k_idx", torch.full(k_shape, -1, dtype=torch.int16, device=device), persistent=False)
        self.register_buffer("v", _zeros(v_shape, dtype, device), persistent=False)
        self.register_buffer("v_idx", torch.full(v_shape, -1, dtype=torch.int16, device=device), persistent=False)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.k_idx.fill_(-1)
        self.v_idx.fill_(-1)


class NuqLevels(nn.Module):
    """KVQuant's nuq levels of one layer (constants: reset keeps them, exports embed them)."""

    def __init__(self, key_levels, value_levels, device):
        super().__init__()
        self.register_buffer("k", torch.tensor(key_levels, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v", torch.tensor(value_levels, dtype=torch.float32, device=device), persistent=False)


class KIVILayer(nn.Module):
    """The nine KIVI buffers of one layer (layout.py) plus `pool`, `sparse` and `levels`."""

    def __init__(self, config: KIVIConfig, layer_idx: int, *, batch_size: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        super().__init__()
        B, H, S, D = batch_size, num_kv_heads, max_seq_len, head_dim
        R, G = config.residual_length, config.group_size
        gv = config.value_group_size(D)
        RR = min(R, S)  # residual slot of token t is t % R < S: a cache shorter than R needs S slots
        for name, shape, dt in (
            ("k_codes", (B, H, S, D // codes_per_byte(config.k_bits)), torch.uint8),
            ("k_scale", (B, H, math.ceil(S / G), D), dtype),
            ("k_zero", (B, H, math.ceil(S / G), D), dtype),
            ("k_res", (B, H, RR, D), dtype),
            ("v_codes", (B, H, S, D // codes_per_byte(config.v_bits)), torch.uint8),
            ("v_scale", (B, H, S, D // gv), dtype),
            ("v_zero", (B, H, S, D // gv), dtype),
            ("v_res", (B, H, RR, D), dtype),
            ("lengths", (B,), torch.int64),
        ):
            self.register_buffer(name, _zeros(shape, dt, device), persistent=False)
        P = config.layer_pool_size(layer_idx)
        self.pool: Optional[TokenPool] = TokenPool(B, H, P, D, dtype, device) if P else None
        nk, nv = config.sparse_counts(D)
        self.sparse: Optional[SparseStore] = (
            SparseStore((B, H, S // R * nk, D), (B, H, S, nv), dtype, device) if nv else None)
        self.levels: Optional[NuqLevels] = (
            NuqLevels(config.key_levels[layer_idx], config.value_levels[layer_idx], device) if config.has_nuq else None)
        self.params = QuantParams(config.k_bits, config.v_bits, G, R, config.sink_tokens if P else 0,
                                  config.layer_outlier_tokens(layer_idx))

    def tensors(self, rope_inv_freq: Optional[torch.Tensor] = None) -> LayerTensors:
        """The layer as the cache ops take it (whole buffers, options None when off)."""
        pool, sparse, levels = self.pool, self.sparse, self.levels
        return LayerTensors(
            self.k_codes, self.k_scale, self.k_zero, self.k_res, self.v_codes, self.v_scale, self.v_zero, self.v_res,
            self.lengths,
            *((pool.k, pool.v, pool.pos) if pool is not None else (None,) * 3),
            *((sparse.k, sparse.k_idx, sparse.v, sparse.v_idx) if sparse is not None else (None,) * 4),
            *((levels.k, levels.v) if levels is not None else (None,) * 2),
            rope_inv_freq,
        )

    def reset(self) -> None:
        """Empty every sequence; the nuq levels stay."""
        for buf in (self.k_codes, self.k_scale, self.k_zero, self.k_res, self.v_codes, self.v_scale, self.v_zero,
                    self.v_res, self.lengths):
            buf.zero_()
        for part in (self.pool, self.sparse):
            if part is not None:
                part.reset()

    def restart_rows(self, fresh: torch.Tensor) -> None:
        """Rows where fresh [B] is True start a new sequence: length 0, pool slots empty (graph-safe;
        the other buffers need no clearing: nothing past a row's length is read)."""
        self.lengths.copy_(torch.where(fresh, torch.zeros_like(self.lengths), self.lengths))
        if self.pool is not None:
            pos = self.pool.pos
            pos.copy_(torch.where(fresh[:, None, None], torch.full_like(pos, -1), pos))

    def constants(self) -> list[torch.Tensor]:
        return [self.levels.k, self.levels.v] if self.levels is not None else []
