"""Orthogonal rotations of the head dimension before quantization (docs/cache.md, "Rotations"):
keys stored k M with the query rotated once per call, values V M with the output rotated back.
The matrix is built once in fp32 and applied as one matmul: at D <= 256 a GEMM costs less than
log2(D) eager butterfly stages."""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

ROTATIONS = ("none", "hadamard", "random")
CACHE_ROTATIONS = ROTATIONS + ("calibrated",)


def check_rotation(name: str, value, kinds=ROTATIONS) -> None:
    if not isinstance(value, str) or value not in kinds:
        raise ValueError(f"{name} must be one of {kinds}, got {value!r}")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalized fast Walsh–Hadamard transform over a power-of-two last dim; its own inverse."""
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
    """A seeded random orthogonal [D, D] fp32 matrix: QR of an fp64 Gaussian from a CPU generator (the
    same on every machine), signs fixed by R's diagonal (Haar-distributed)."""
    g = torch.Generator().manual_seed(int(seed))
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(torch.float32)


def rotation_matrix(kind: str, head_dim: int, seed: int = 0) -> Optional[torch.Tensor]:
    """The [D, D] fp32 orthogonal M of a kind (x -> x M): Hadamard for a power of two, else random."""
    check_rotation("rotation", kind)
    if kind == "none":
        return None
    if kind == "hadamard" and is_power_of_two(head_dim):
        return fwht(torch.eye(head_dim, dtype=torch.float64)).to(torch.float32)
    return random_orthogonal(head_dim, seed)


def _times(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ m [D, D], or per head with m [H, D, D]: query head i uses KV head i // (heads / H)."""
    if m.dim() == 2:
        return torch.matmul(x.float(), m)
    *lead, heads, T, D = x.shape
    H = m.shape[0]
    y = torch.matmul(x.float().reshape(*lead, H, heads // H, T, D), m[:, None])
    return y.reshape(*lead, heads, T, D)


def rotate(x: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """x times M in fp32, returned in x's dtype (x itself when M is None)."""
    if m is None:
        return x
    return _times(x, m).to(x.dtype)


def unrotate(x: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
    """x times Mᵀ (rotate's inverse), in fp32, returned in x's dtype."""
    if m is None:
        return x
    return _times(x, m.transpose(-1, -2)).to(x.dtype)


class CalibratedRotations:
    """Immutable [L, H, D, D] fp32 key and value rotations from a calibration file; equal by digest,
    shared on copy."""

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
