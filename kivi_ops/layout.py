"""What the two cache ops take: a layer's tensors and settings, NamedTuples in schema order (the op
schemas are generated from their fields). Layout (S max_seq_len, W = R, or R + G - 1 under OTT):
    k_codes  uint8 [B, H, S, D*kb/8]     keys per channel, packed along D (kernels/reference/packing.py)
    k_scale, k_zero  dtype [B, H, ceil(S/G), D]
    k_res    dtype [B, H, min(W,S), D]   exact key residual, token t in slot t % W
    v_codes  uint8 [B, H, S, D*vb/8]     values per token in groups of Gv = min(G, D) channels
    v_scale, v_zero  dtype [B, H, S, D/Gv]
    v_res    dtype [B, H, min(W,S), D]   exact value window (ring)
    lengths  int64 [B]
Quantized token t lives at row t of the codes, row t // G of the key scales. Options (None when
off): pool (pool.py), sparse store (extras.py), nuq levels, pre-RoPE frequencies.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor

from .options.extras import Extras


class LayerTensors(NamedTuple):
    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    k_res: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_zero: Tensor
    v_res: Tensor
    lengths: Tensor
    pool_k: Optional[Tensor] = None
    pool_v: Optional[Tensor] = None
    pool_pos: Optional[Tensor] = None
    k_sparse: Optional[Tensor] = None
    k_sparse_idx: Optional[Tensor] = None
    v_sparse: Optional[Tensor] = None
    v_sparse_idx: Optional[Tensor] = None
    k_levels: Optional[Tensor] = None
    v_levels: Optional[Tensor] = None
    rope_inv_freq: Optional[Tensor] = None

    @property
    def kivi(self) -> tuple[Tensor, ...]:
        return tuple(self[:KIVI_TENSORS])

    @property
    def pool(self) -> Optional[tuple[Tensor, Tensor, Tensor]]:
        if self.pool_pos is None or self.pool_pos.shape[-1] == 0:
            return None
        return self.pool_k, self.pool_v, self.pool_pos

    @property
    def extras(self) -> Extras:
        return Extras(**{name: getattr(self, name) for name in Extras._fields})


KIVI_TENSORS = 9
REQUIRED_TENSORS = LayerTensors._fields[:KIVI_TENSORS]
APPEND_MUTATES = REQUIRED_TENSORS + ("pool_k", "pool_v", "pool_pos", "k_sparse", "k_sparse_idx", "v_sparse",
                                     "v_sparse_idx")


class QuantParams(NamedTuple):
    k_bits: int
    v_bits: int
    group_size: int
    residual_length: int
    sink_tokens: int = 0
    outlier_tokens: int = 0
    flush_policy: int = 0

    def pool_args(self, t: LayerTensors):
        pool = t.pool
        return None if pool is None else (*pool, self.sink_tokens, self.outlier_tokens)




def layer_schema(mutable: bool) -> str:
    """LayerTensors as schema arguments: optional parts `Tensor?`, append's writes aliased `(aN!)`."""
    args = []
    for i, name in enumerate(LayerTensors._fields):
        alias = f"(a{i}!)" if mutable and name in APPEND_MUTATES else ""
        args.append(f"Tensor{alias}{'' if name in REQUIRED_TENSORS else '?'} {name}")
    return ", ".join(args)


PARAMS_SCHEMA = ", ".join(f"int {name}" for name in QuantParams._fields)


def bind_args(names: tuple[str, ...], args, kwargs, defaults: Optional[dict] = None) -> list:
    """An op's arguments in schema order; `defaults` fills omitted ones (the dispatcher drops them)."""
    defaults = defaults or {}
    return [*args, *(kwargs[name] if name in kwargs else defaults[name] for name in names[len(args):])]
