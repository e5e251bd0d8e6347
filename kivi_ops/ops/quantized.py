"""Public quantize / fake_quantize API over the `kivi::quantize_pack` and `kivi::unpack_dequantize` ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor [..., T, D] as packed codes plus per-group scale and zero."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    axis: str

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 8 // self.bits))

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def dequantize(self) -> torch.Tensor:
        return torch.ops.kivi.unpack_dequantize(self.codes, self.scale, self.zero, self.bits, self.group_size, self.axis)


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str) -> QuantizedTensor:
    """Quantize x [..., T, D]: axis="channel" groups G tokens per channel (T % G == 0), "token" G
    channels per token. Zero tokens give an empty QuantizedTensor."""
    codes, scale, zero = torch.ops.kivi.quantize_pack(x, bits, group_size, axis)
    return QuantizedTensor(codes, scale, zero, bits, group_size, axis)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, axis: str) -> torch.Tensor:
    return quantize(x, bits, group_size, axis).dequantize()
