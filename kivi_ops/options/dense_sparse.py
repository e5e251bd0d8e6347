"""KVQuant's per-vector dense-and-sparse quantization: a small fraction of each vector (a key
channel, a value token) stays exact and out of the quantization range of the rest."""

from __future__ import annotations


import torch

from ..config import check_axis


def check_outlier_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 0.5:
        raise ValueError(f"outlier fraction must be a number in [0, 0.5), e.g. 0.01, got {fraction!r}")


def outlier_count(fraction: float, vector_length: int) -> int:
    return max(1, round(fraction * vector_length)) if fraction > 0 else 0


def select_outliers(x: torch.Tensor, count: int, dim: int, ignore: torch.Tensor | None = None):
    """The count largest-magnitude entries along dim per vector: (mask, exact values, int16 indices),
    by decreasing magnitude, lowest index first among equals; `ignore`d entries are picked last. One
    argmax per pick, not topk, whose order among ties differs between devices; the Triton append
    kernels follow the same rule."""
    mag = x.float().abs()
    if ignore is not None:
        mag = mag.masked_fill(ignore, -1.0)
    picks = []
    for _ in range(count):
        pick = mag.argmax(dim=dim, keepdim=True)
        picks.append(pick)
        mag = mag.scatter(dim, pick, -2.0)
    idx = torch.cat(picks, dim=dim)
    mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(dim, idx, True)
    return mask, torch.gather(x, dim, idx), idx.to(torch.int16)


def outlier_mask(x: torch.Tensor, fraction: float, axis: str) -> torch.Tensor:
    """True at the outliers of x [..., T, D] per vector (a channel over T, or a token's D channels)."""
    check_outlier_fraction(fraction)
    check_axis(axis)
    dim = -2 if axis == "channel" else -1
    k = outlier_count(fraction, x.shape[dim])
    if k == 0:
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    return select_outliers(x, k, dim)[0]
