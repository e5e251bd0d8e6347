"""KVQuant's options as optional inputs of the cache ops (docs/cache.md, "KVQuant"), None when off.
Sparse store: k_sparse, k_sparse_idx [B, H, (S // R) * nk, D], row w * nk + j holding per channel
the j-th outlier of R-token window w and its int16 offset; v_sparse, v_sparse_idx [B, H, S, nv]."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .dense_sparse import select_outliers

class Extras(NamedTuple):
    k_levels: Optional[Tensor] = None
    v_levels: Optional[Tensor] = None
    k_sparse: Optional[Tensor] = None
    k_sparse_idx: Optional[Tensor] = None
    v_sparse: Optional[Tensor] = None
    v_sparse_idx: Optional[Tensor] = None
    rope_inv_freq: Optional[Tensor] = None

    @property
    def active(self) -> bool:
        return any(t is not None for t in self)

    @property
    def sparse(self) -> bool:
        return self.k_sparse is not None


NO_EXTRAS = Extras()


def check_extras(extras: Extras, k_codes: Tensor, k_res: Tensor, k_bits: int, v_bits: int, residual_length: int) -> None:
    """Shapes and dtypes of the extras against the cache buffers, without reading values (a host sync
    in CUDA graphs); KIVIConfig checks the levels' order."""
    B, H, S, _ = k_codes.shape
    D, dtype = k_res.shape[-1], k_res.dtype
    for name, levels, bits in (("k_levels", extras.k_levels, k_bits), ("v_levels", extras.v_levels, v_bits)):
        if levels is not None and (levels.shape != (2**bits,) or levels.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 [{2**bits}] (levels of {bits}-bit codes), "
                             f"got {levels.dtype} {list(levels.shape)}")
    if (extras.k_levels is None) != (extras.v_levels is None):
        raise ValueError("k_levels and v_levels must be given together")
    sparse = (extras.k_sparse, extras.k_sparse_idx, extras.v_sparse, extras.v_sparse_idx)
    if any(t is not None for t in sparse):
        if any(t is None for t in sparse):
            raise ValueError("k_sparse, k_sparse_idx, v_sparse and v_sparse_idx must be given together")
        k_val, k_idx, v_val, v_idx = sparse
        windows = S // residual_length
        rows = k_val.shape[2] if k_val.dim() == 4 else -1
        if (k_val.dim() != 4 or tuple(k_val.shape) != (B, H, rows, D) or (windows and rows % windows)
                or (not windows and rows)):
            raise ValueError(f"k_sparse must be [B, H, (S // R) * nk, D] = [{B}, {H}, {windows} * nk, {D}], "
                             f"got {list(k_val.shape)}")
        nv = v_val.shape[-1] if v_val.dim() == 4 else -1
        if v_val.dim() != 4 or tuple(v_val.shape[:3]) != (B, H, S) or not 0 < nv <= D:
            raise ValueError(f"v_sparse must be [B, H, S, nv] = [{B}, {H}, {S}, 1..{D}], got {list(v_val.shape)}")
        if k_idx.shape != k_val.shape or v_idx.shape != v_val.shape:
            raise ValueError("k_sparse_idx / v_sparse_idx must have the shapes of k_sparse / v_sparse")
        if k_val.dtype != dtype or v_val.dtype != dtype or k_idx.dtype != torch.int16 or v_idx.dtype != torch.int16:
            raise ValueError(f"k_sparse/v_sparse must have the cache dtype {dtype} and their indices int16")
    f = extras.rope_inv_freq
    if f is not None and (f.shape != (D // 2,) or f.dtype != torch.float32):
        raise ValueError(f"rope_inv_freq must be float32 [{D // 2}] (head_dim / 2), got {f.dtype} {list(f.shape)}")


def key_outliers_per_window(k_sparse: Tensor, S: int, R: int) -> int:
    return k_sparse.shape[2] // (S // R) if S // R else 0


def select_key_outliers(stream: Tensor, nk: int, R: int, pooled: Optional[Tensor] = None):
    """stream [B, H, windows * R, D] of exact keys about to be quantized -> (exclude mask, values
    [B, H, windows * nk, D], int16 offsets); pooled tokens are picked last."""
    B, H, W, D = stream.shape
    ignore = None if pooled is None else pooled.reshape(B, H, W // R, R, 1).expand(B, H, W // R, R, D)
    mask, vals, idx = select_outliers(stream.reshape(B, H, W // R, R, D), nk, dim=3, ignore=ignore)
    return mask.reshape(B, H, W, D), vals.reshape(B, H, -1, D), idx.reshape(B, H, -1, D)


def _replace_along(x: Tensor, dim: int, target: Tensor, src: Tensor, hit: Tensor) -> Tensor:
    """x with x[..., target, ...] = src along dim where hit; misses go to a spare slot cut off again
    (static shapes: no boolean indexing)."""
    n = x.shape[dim]
    pad_shape = list(x.shape)
    pad_shape[dim] = 1
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    index = torch.where(hit, target, torch.full_like(target, n))
    return padded.scatter(dim, index, torch.where(hit, src.to(x.dtype), torch.zeros((), dtype=x.dtype,
                                                                                        device=x.device))).narrow(dim, 0, n)


def apply_key_outliers(keys: Tensor, start: int, k_sparse: Tensor, k_sparse_idx: Tensor, nk: int, R: int) -> Tensor:
    """keys [B, H, T, D] (fp32 rows [start, start + T)) with their exact key outliers written in."""
    if nk == 0:
        return keys
    T = keys.shape[2]
    window = torch.div(torch.arange(k_sparse.shape[2], device=keys.device), nk, rounding_mode="floor")
    offset = k_sparse_idx.long()
    position = window[None, None, :, None] * R + offset
    hit = (offset >= 0) & (position >= start) & (position < start + T)
    return _replace_along(keys, 2, position - start, k_sparse, hit)


def apply_value_outliers(values: Tensor, v_sparse: Tensor, v_sparse_idx: Tensor) -> Tensor:
    """values [B, H, T, D] (fp32) with the exact outliers v_sparse / v_sparse_idx [B, H, T, nv] written in."""
    idx = v_sparse_idx.long()
    return _replace_along(values, 3, idx, v_sparse, idx >= 0)
