"""What the two cache ops take: one layer's tensors (`LayerTensors`) and its settings (`QuantParams`).

Both are NamedTuples in the ops' schema order: the op schemas in ops.py are generated from their
fields, and every implementation (reference, decomposed, Triton) receives the same two bundles,
so the argument list is written once, here.

Layout of one layer (B batch, H kv heads, S max_seq_len, D head_dim, R residual, G group):
    k_codes  uint8 [B, H, S, D*kb/8]     keys quantized per channel, packed along D (packing.py)
    k_scale  dtype [B, H, ceil(S/G), D]  one scale/zero per (group of G tokens, channel)
    k_zero   dtype [B, H, ceil(S/G), D]
    k_res    dtype [B, H, min(W,S), D]   full-precision key residual (W = R, or R + G - 1 under OTT's policy)
    v_codes  uint8 [B, H, S, D*vb/8]     values quantized per token in groups of Gv=min(G, D) channels
    v_scale  dtype [B, H, S, D/Gv]
    v_zero   dtype [B, H, S, D/Gv]
    v_res    dtype [B, H, min(W,S), D]   full-precision value window (ring buffer)
    lengths  int64 [B]                   tokens stored per sequence
Optional parts, None when their option is off:
    pool_k, pool_v, pool_pos             sink / OTT outlier token pool (pool.py)
    k_sparse, k_sparse_idx, v_sparse, v_sparse_idx   dense-and-sparse outlier store (extras.py)
    k_levels, v_levels                   nuq levels (constants)
    rope_inv_freq                        RoPE frequencies of pre-RoPE keys (a constant)

For a sequence of length L (KIVI Algorithm 1, paper-faithful streaming):
    keys:   tokens [0, nqk) are quantized, nqk = (L // R) * R; tokens [nqk, L) are in k_res.
            When the residual reaches R tokens, all R are quantized together (R/G groups).
    values: tokens [0, nqv) are quantized, nqv = max(L - R, 0); the last min(L, R) are in v_res.
    In both residuals token t lives in slot t % R.
Under flush_policy OTT (schedule.py): keys and values alike, tokens [0, nq) are quantized with
    nq = G * floor(max(L - R, 0) / G), G at a time; tokens [nq, L) (R .. R + G - 1 of them once
    L >= R) are exact in k_res / v_res, token t in slot t % (R + G - 1).
Quantized tokens live at row t of the codes (and row t // G of the key scales).
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
        """The nine tensors every KIVI layer has (k_codes .. lengths)."""
        return tuple(self[:KIVI_TENSORS])

    @property
    def pool(self) -> Optional[tuple[Tensor, Tensor, Tensor]]:
        """(pool_k, pool_v, pool_pos), or None without a pool (or with zero slots)."""
        if self.pool_pos is None or self.pool_pos.shape[-1] == 0:
            return None
        return self.pool_k, self.pool_v, self.pool_pos

    @property
    def extras(self) -> Extras:
        """KVQuant's parts (nuq levels, sparse store, RoPE frequencies) as the kernels read them."""
        return Extras(**{name: getattr(self, name) for name in Extras._fields})  # by name: order-proof


KIVI_TENSORS = 9
# Tensors that must be given (the rest are Optional), and those cache_append writes.
REQUIRED_TENSORS = LayerTensors._fields[:KIVI_TENSORS]
APPEND_MUTATES = REQUIRED_TENSORS + ("pool_k", "pool_v", "pool_pos", "k_sparse", "k_sparse_idx", "v_sparse",
                                     "v_sparse_idx")


class QuantParams(NamedTuple):
    """The ops' integer settings (KIVIConfig's, resolved for one layer)."""

    k_bits: int
    v_bits: int
    group_size: int
    residual_length: int
    sink_tokens: int = 0
    outlier_tokens: int = 0  # this layer's OTT pool size (0 in skipped layers)
    flush_policy: int = 0  # schedule.KIVI (0) or schedule.OTT (1): when tokens leave full precision

    def pool_args(self, t: LayerTensors):
        """The pool as the append implementations take it: (pool_k, pool_v, pool_pos, sink,
        outliers), or None."""
        pool = t.pool
        return None if pool is None else (*pool, self.sink_tokens, self.outlier_tokens)


# ---------------------------------------------------------------- the cache ops' schemas (ops.py, paged_ops.py)


def layer_schema(mutable: bool) -> str:
    """LayerTensors as schema arguments: optional parts `Tensor?`, append's writes aliased `(aN!)`."""
    args = []
    for i, name in enumerate(LayerTensors._fields):
        alias = f"(a{i}!)" if mutable and name in APPEND_MUTATES else ""
        args.append(f"Tensor{alias}{'' if name in REQUIRED_TENSORS else '?'} {name}")
    return ", ".join(args)


PARAMS_SCHEMA = ", ".join(f"int {name}" for name in QuantParams._fields)


def bind_args(names: tuple[str, ...], args, kwargs, defaults: Optional[dict] = None) -> list:
    """An op's arguments in schema order, whether they came positionally, by name, or not at all
    (`defaults`: the schema's defaults, which the dispatcher does not pass on when a call omits them)."""
    defaults = defaults or {}
    return [*args, *(kwargs[name] if name in kwargs else defaults[name] for name in names[len(args):])]
