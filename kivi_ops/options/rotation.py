"""Orthogonal rotations of the head dimension, applied before quantization (QuaRot, RotateKV,
TurboQuant): an option of the cache (KIVIConfig.rotate_keys / rotate_values) and of fake quantization.

Attention is unchanged by an orthogonal M (M Mᵀ = I), with vectors as rows:
    keys:   q·k = (q M)·(k M)                            store k M, rotate the query once per call
    values: softmax(s) V = (softmax(s) (V M)) Mᵀ         store V M, rotate the output back
so the kernels see rotated vectors and need no change. The rotation spreads a channel's outlier
over all channels, which helps per-token quantization (values, and the per-token baselines) and
may hurt KIVI's per-channel keys, whose groups exploit those outliers: docs/quality.md measures it.

Kinds: "none"; "calibrated" (the cache only: per layer and KV head, calibrated_rotation.py); "hadamard", the normalized Walsh–Hadamard matrix (entries ±1/sqrt(D)) when head_dim
is a power of two, else the seeded random matrix; "random", a seeded random orthogonal matrix (QR
of a seeded Gaussian, signs fixed so it is Haar-distributed). The matrix is built once, in fp32,
with `fwht` (the fast transform, O(D log D) per vector) applied to the identity, and applied as
one small matmul: at D <= 256 one GEMM per call costs less than log2(D) eager butterfly stages.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

ROTATIONS = ("none", "hadamard", "random")
# the cache's kinds: also "calibrated", per layer and KV head from a calibration file (calibrated_rotation.py)
CACHE_ROTATIONS = ROTATIONS + ("calibrated",)


def check_rotation(name: str, value, kinds=ROTATIONS) -> None:
    if not isinstance(value, str) or value not in kinds:
        raise ValueError(f"{name} must be one of {kinds}, got {value!r}")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The normalized fast Walsh–Hadamard transform over the last dim (a power of two): x H with
    H the Sylvester Hadamard matrix / sqrt(D), symmetric and orthogonal (fwht(fwht(x)) == x)."""
    D = x.shape[-1]
    if not is_power_of_two(D):
        raise ValueError(f"the Walsh–Hadamard transform needs a power-of-two last dim, got {D}")
    shape, h = x.shape, 1
    y = x.reshape(-1, D)
    while h < D:
        y = y.view(-1, D // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) / D**0.5).to(x.dtype)


def random_orthogonal(head_dim: int, seed: int = 0) -> torch.Tensor:
    """A seeded random orthogonal [D, D] fp32 matrix: Q of the QR of a Gaussian (fp64, CPU
    generator, so the same seed gives the same matrix on every machine), columns' signs set by
    R's diagonal."""
    g = torch.Generator().manual_seed(int(seed))
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(torch.float32)


def rotation_matrix(kind: str, head_dim: int, seed: int = 0) -> Optional[torch.Tensor]:
    """The [head_dim, head_dim] fp32 orthogonal matrix M of a rotation kind (x -> x M), or None for "none"."""
    check_rotation("rotation", kind)
    if kind == "none":
        return None
    if kind == "hadamard" and is_power_of_two(head_dim):
        return fwht(torch.eye(head_dim, dtype=torch.float64)).to(torch.float32)
    return random_orthogonal(head_dim, seed)


def _times(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ m [D, D], or per head: x [..., heads, T, D] @ m [H, D, D] where head i uses
    matrix i // (heads / H) (a query head uses its KV head's matrix, GQA's grouping)."""
    if m.dim() == 2:
        return torch.matmul(x.float(), m)
    *lead, heads, T, D = x.shape
    H = m.shape[0]
    y = torch.matmul(x.float().reshape(*lead, H, heads // H, T, D), m[:, None])
    return y.reshape(*lead, heads, T, D)


def rotate(x: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., D] times M ([D, D], or [H, D, D] per KV head: _times), computed in fp32 and returned
    in x's dtype (x itself when M is None)."""
    if m is None:
        return x
    return _times(x, m).to(x.dtype)


def unrotate(x: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., D] times Mᵀ (the inverse of rotate), in fp32, returned in x's dtype."""
    if m is None:
        return x
    return _times(x, m.transpose(-1, -2)).to(x.dtype)


class CalibratedRotations:
    """Immutable [L, H, D, D] fp32 key and value rotations from a calibration file; configs holding
    the same matrices compare equal (by digest), and copying one shares it."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, source: str):
        if keys.shape != values.shape or keys.dim() != 4 or keys.shape[-1] != keys.shape[-2]:
            raise ValueError(f"rotations must be key and value tensors [layers, kv_heads, head_dim, head_dim] of one "
                             f"shape, got {tuple(keys.shape)} and {tuple(values.shape)}")
        self.keys, self.values, self.source = keys.float().contiguous(), values.float().contiguous(), str(source)
        h = hashlib.sha256()
        for t in (self.keys, self.values):
            h.update(t.numpy().tobytes())
        self.digest = h.hexdigest()[:16]

    @property
    def shape(self) -> tuple:
        return tuple(self.keys.shape)

    def heads(self, start: int, count: int) -> "CalibratedRotations":
        """The rotations of KV heads [start, start + count) (one tensor-parallel rank's heads)."""
        return CalibratedRotations(self.keys[:, start:start + count], self.values[:, start:start + count],
                                   f"{self.source}[heads {start}:{start + count}]")

    def record(self) -> dict:
        return dict(file=self.source, sha256=self.digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, CalibratedRotations) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"CalibratedRotations({self.source!r}, shape={self.shape}, sha256={self.digest})"
