"""KVQuant's per-vector dense-and-sparse quantization (the KVQuant paper, Section 3.4): in each vector a
small fraction of numerical outliers stays in full precision (stored sparsely) and out of the
quantization range of the rest.

Vectors follow the quantization axis: keys are quantized per channel, so a key outlier is
extreme within its channel (over the tokens at hand); values are quantized per token, so a value
outlier is extreme within its token's channels. KVQuant calibrates the per-channel key thresholds
offline and computes the per-token value thresholds online; this fake-quantization path computes
both from the tensor it is given (for keys, an upper bound on what offline thresholds reach).
"""

from __future__ import annotations


import torch

from ..config import check_axis


def check_outlier_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 0.5:
        raise ValueError(f"outlier fraction must be a number in [0, 0.5), e.g. 0.01, got {fraction!r}")


def outlier_count(fraction: float, vector_length: int) -> int:
    """Outliers per vector: the fraction of its length, rounded (at least 1 when fraction > 0)."""
    return max(1, round(fraction * vector_length)) if fraction > 0 else 0


def select_outliers(x: torch.Tensor, count: int, dim: int, ignore: torch.Tensor | None = None):
    """The count entries of largest magnitude along dim, per vector of x: (mask of x's shape,
    their exact values, their indices along dim as int16), in order of decreasing magnitude; of
    equal magnitudes the lowest index comes first. ignore (x's shape, bool): entries picked only
    after every other one (pooled tokens, exact elsewhere). The one outlier selection: the cache's
    sparse store and fake quantization both use it, and the Triton append kernels follow the same
    rule (triton_append._pick_largest), so every implementation keeps the same entries.

    One argmax per outlier (counts are small: 1% of a vector) rather than topk, whose order among
    ties is unspecified and differs between devices; argmax returns the first maximal index.
    Magnitudes are >= 0; ignored entries count as -1, picked ones as -2."""
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
    """True at the outliers of x [..., T, D]: per vector (a channel over T tokens for axis
    "channel", a token's D channels for "token"), the elements of largest magnitude."""
    check_outlier_fraction(fraction)
    check_axis(axis)
    dim = -2 if axis == "channel" else -1
    k = outlier_count(fraction, x.shape[dim])
    if k == 0:
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    return select_outliers(x, k, dim)[0]
