"""KIVICache: a preallocated, static-shape KV cache stored the KIVI way.

Each layer owns nine separately registered buffers (layout in cache_reference.py), plus three
for the sink / OTT outlier pool when those options are on (pool.py; the pool ops
kivi::cache_append_pool / cache_attend_pool then replace the plain ones). Ops always receive
whole buffers, so a compiled decode step updates them in place without copies.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import ops  # noqa: F401  (registers torch.ops.kivi)
from .cache_reference import check_capacity
from .config import KIVIConfig
from .extras import Extras
from .ops import CACHE_BUFFERS
from .packing import FLOAT_DTYPES, codes_per_byte
from .pool import POOL_BUFFERS
from .rope import rope_at

IMPLS = ("op", "decomposed")
# Buffers that hold constants, not sequence state: reset() keeps them, exporters keep them in the
# program rather than passing them as state (KVQuant's nuq levels and RoPE frequencies).
CONSTANT_BUFFER_PREFIXES = ("k_levels_", "v_levels_", "rope_inv_freq")


def is_constant_buffer(name: str) -> bool:
    return name.startswith(CONSTANT_BUFFER_PREFIXES)
ATTEND_FORMS = ("auto", "fused", "materialized")


def _decomposed():
    from . import decomposed

    return decomposed


def fp16_cache_nbytes(*, num_layers: int, batch_size: int, num_tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of an unquantized fp16 K+V cache holding num_tokens tokens per sequence."""
    return 2 * num_layers * batch_size * num_kv_heads * num_tokens * head_dim * 2


class StaticCacheBase(nn.Module):
    """What every static cache here shares: dimensions, per-layer length buffers, byte accounting."""

    def __init__(self, *, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        super().__init__()
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size),
                            ("max_seq_len", max_seq_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16, got {dtype}")
        self.num_layers, self.batch_size, self.max_seq_len = num_layers, batch_size, max_seq_len
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype

    @property
    def device(self) -> torch.device:
        return self.lengths_0.device

    def lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens stored per sequence (a device tensor; no sync)."""
        return getattr(self, f"lengths_{layer_idx}")

    def reset(self) -> None:
        for buf in self.buffers():
            buf.zero_()

    def fp16_nbytes(self, num_tokens: Optional[int] = None) -> int:
        """Bytes an fp16 K+V cache would need for num_tokens (default max_seq_len) per sequence."""
        return fp16_cache_nbytes(
            num_layers=self.num_layers, batch_size=self.batch_size,
            num_tokens=self.max_seq_len if num_tokens is None else num_tokens,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        )


class KIVICache(StaticCacheBase):
    def __init__(
        self,
        config: KIVIConfig,
        *,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rope_inv_freq: Optional[torch.Tensor] = None,
        rope_scaling: float = 1.0,
    ):
        """rope_inv_freq / rope_scaling: the model's RoPE frequencies [head_dim / 2] and
        attention_scaling (rope.model_rope_frequencies), required when config.pre_rope."""
        if not isinstance(config, KIVIConfig):
            raise TypeError(f"config must be a KIVIConfig, got {type(config).__name__}")
        super().__init__(num_layers=num_layers, batch_size=batch_size, max_seq_len=max_seq_len,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        config.check_head_dim(head_dim)
        if config.outlier_tokens and config.outlier_skip_layers >= num_layers:
            raise ValueError(
                f"outlier_tokens={config.outlier_tokens} would apply to no layer: outlier_skip_layers="
                f"{config.outlier_skip_layers} skips all {num_layers} (lower it or set outlier_tokens=0)"
            )
        if config.has_nuq and (len(config.key_levels) != num_layers or len(config.value_levels) != num_layers):
            raise ValueError(f"key_levels/value_levels must have one entry per layer ({num_layers}), "
                             f"got {len(config.key_levels)} and {len(config.value_levels)}")
        if config.pre_rope:
            if not isinstance(rope_inv_freq, torch.Tensor) or rope_inv_freq.shape != (head_dim // 2,):
                raise ValueError(f"pre_rope=True needs rope_inv_freq, the model's RoPE frequencies [head_dim / 2 = "
                                 f"{head_dim // 2}] (kivi_models.make_cache passes them), got "
                                 f"{getattr(rope_inv_freq, 'shape', rope_inv_freq)}")
        elif rope_inv_freq is not None:
            raise ValueError("rope_inv_freq is only used with pre_rope=True")
        self.config = config
        self.rope_scaling = float(rope_scaling)
        self.impl, self.attend_form = "op", "auto"
        device = torch.device(device)
        B, H, S, D, R, G = batch_size, num_kv_heads, max_seq_len, head_dim, config.residual_length, config.group_size
        gv = config.value_group_size(D)
        # Residual slot of token t is t % R < S: a cache shorter than R needs only S slots.
        shapes = {
            "k_codes": ((B, H, S, D // codes_per_byte(config.k_bits)), torch.uint8),
            "k_scale": ((B, H, math.ceil(S / G), D), dtype),
            "k_zero": ((B, H, math.ceil(S / G), D), dtype),
            "k_res": ((B, H, min(R, S), D), dtype),
            "v_codes": ((B, H, S, D // codes_per_byte(config.v_bits)), torch.uint8),
            "v_scale": ((B, H, S, D // gv), dtype),
            "v_zero": ((B, H, S, D // gv), dtype),
            "v_res": ((B, H, min(R, S), D), dtype),
            "lengths": ((B,), torch.int64),
        }
        for layer in range(num_layers):
            for name in CACHE_BUFFERS:
                shape, dt = shapes[name]
                self.register_buffer(f"{name}_{layer}", torch.zeros(shape, dtype=dt, device=device), persistent=False)
            # Sink / OTT outlier pool (pool.py): only for layers that have one (none when the options are off).
            P = config.layer_pool_size(layer)
            if P:
                self.register_buffer(f"pool_k_{layer}", torch.zeros((B, H, P, D), dtype=dtype, device=device),
                                     persistent=False)
                self.register_buffer(f"pool_v_{layer}", torch.zeros((B, H, P, D), dtype=dtype, device=device),
                                     persistent=False)
                self.register_buffer(f"pool_pos_{layer}", torch.full((B, H, P), -1, dtype=torch.int64, device=device),
                                     persistent=False)
            # KVQuant (extras.py): nuq levels, the dense-and-sparse store.
            if config.has_nuq:
                for name, levels in (("k_levels", config.key_levels[layer]), ("v_levels", config.value_levels[layer])):
                    self.register_buffer(f"{name}_{layer}", torch.tensor(levels, dtype=torch.float32, device=device),
                                         persistent=False)
            nk, nv = config.sparse_counts(D)
            if nv:
                for name, shape in (("k_sparse", (B, H, S // R * nk, D)), ("v_sparse", (B, H, S, nv))):
                    self.register_buffer(f"{name}_{layer}", torch.zeros(shape, dtype=dtype, device=device),
                                         persistent=False)
                    self.register_buffer(f"{name}_idx_{layer}", torch.full(shape, -1, dtype=torch.int16, device=device),
                                         persistent=False)
        if config.pre_rope:
            self.register_buffer("rope_inv_freq", rope_inv_freq.detach().to(device=device, dtype=torch.float32).clone(),
                                 persistent=False)

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"{name}_{layer_idx}") for name in CACHE_BUFFERS)

    def pool_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """(pool_k, pool_v, pool_pos) of a layer with a sink/outlier pool, () otherwise."""
        if not self.config.layer_pool_size(layer_idx):
            return ()
        return tuple(getattr(self, f"{name}_{layer_idx}") for name in POOL_BUFFERS)

    def layer_extras(self, layer_idx: int, *, attend: bool = False) -> Extras:
        """KVQuant's inputs of a layer's ops (extras.py); all None when the options are off.
        rope_inv_freq is an input of attention only."""
        c = self.config
        get = lambda name, on: getattr(self, f"{name}_{layer_idx}") if on else None  # noqa: E731
        sparse = c.sparse_outliers > 0
        return Extras(get("k_levels", c.has_nuq), get("v_levels", c.has_nuq),
                      get("k_sparse", sparse), get("k_sparse_idx", sparse),
                      get("v_sparse", sparse), get("v_sparse_idx", sparse),
                      self.rope_inv_freq if c.pre_rope and attend else None)

    def nbytes(self) -> int:
        """Exact bytes held: codes + scales + zeros + residual buffers + lengths, the sink /
        outlier pools (keys, values, positions) and KVQuant's parts (sparse outlier values and
        indices, nuq levels, RoPE frequencies) where the options are on, all layers."""
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    def reset(self) -> None:
        """Empty every sequence: state buffers to zero, slot indices to -1 (empty); the constants
        (nuq levels, RoPE frequencies) stay."""
        for name, buf in self.named_buffers():
            if is_constant_buffer(name):
                continue
            buf.fill_(-1 if name.startswith(("pool_pos_", "k_sparse_idx_", "v_sparse_idx_")) else 0)

    # ------------------------------------------------------------------ checks

    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, {self.num_layers}), got {layer_idx!r}")

    def _check_tensor(self, name: str, t: torch.Tensor, heads: Optional[int]) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, tokens, head_dim], got {getattr(t, 'shape', t)}")
        B, H, _, D = t.shape
        if B != self.batch_size or D != self.head_dim or (heads is not None and H != heads):
            want = f"[{self.batch_size}, {heads if heads is not None else 'heads'}, tokens, {self.head_dim}]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{name} must have the cache dtype {self.dtype}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on the cache device {self.device}, got {t.device}")

    def _check_counts(self, counts: Optional[torch.Tensor], n: int) -> None:
        if counts is None:
            return
        if counts.shape != (self.batch_size,) or counts.dtype != torch.int64 or counts.device != self.device:
            raise ValueError(
                f"counts must be an int64 tensor of shape [{self.batch_size}] on {self.device}, "
                f"got {counts.dtype} {list(counts.shape)} on {counts.device}"
            )
        if not torch.compiler.is_compiling() and bool(((counts < 0) | (counts > n)).any()):
            raise ValueError(f"counts must lie in [0, {n}] (the number of new tokens), got {counts.tolist()}")

    # ------------------------------------------------------------------ ops

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        """Store key/value [batch, kv_heads, n, head_dim]; row b's first counts[b] tokens are real
        (right padding), the rest are never stored. Raises before writing if a sequence would
        exceed max_seq_len (in eager mode and in compiled mode on CPU; the CUDA kernel drops
        tokens past capacity instead, since it cannot raise inside a CUDA graph)."""
        self._check_layer(layer_idx)
        self._check_tensor("key", key, self.num_kv_heads)
        self._check_tensor("value", value, self.num_kv_heads)
        if key.shape != value.shape:
            raise ValueError(f"key and value must have the same shape, got {list(key.shape)} and {list(value.shape)}")
        self._check_counts(counts, key.shape[2])
        if not torch.compiler.is_compiling():  # the CUDA kernel cannot raise: check here, in eager mode
            check_capacity(self.lengths(layer_idx), counts, key.shape[2], self.max_seq_len)
        c = self.config
        pool = self.pool_buffers(layer_idx)
        extras = self.layer_extras(layer_idx)
        if pool:
            extra = (c.sink_tokens, c.layer_outlier_tokens(layer_idx))
            if self.impl == "op":
                torch.ops.kivi.cache_append_pool(*self.layer_buffers(layer_idx), *pool, key, value, counts,
                                                 c.k_bits, c.v_bits, c.group_size, c.residual_length, *extra, *extras[:6])
            else:
                _decomposed().cache_append_decomposed(*self.layer_buffers(layer_idx), key, value, counts, c.k_bits,
                                                      c.v_bits, c.group_size, c.residual_length, pool=(*pool, *extra),
                                                      extras=extras)
            return
        args = (*self.layer_buffers(layer_idx), key, value, counts, c.k_bits, c.v_bits, c.group_size, c.residual_length)
        if self.impl == "op":
            torch.ops.kivi.cache_append(*args, *extras[:6])
        else:
            _decomposed().cache_append_decomposed(*args, extras=extras)

    def attend(self, layer_idx: int, query: torch.Tensor, scale: Optional[float] = None,
               counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of query [batch, q_heads, q_len, head_dim] over the cache (quantized part +
        residual, one softmax, GQA, causal for q_len > 1: the queries' own keys must already be
        appended). counts marks the real queries of right-padded rows, as in append."""
        self._check_layer(layer_idx)
        self._check_tensor("query", query, None)
        if query.shape[1] % self.num_kv_heads:
            raise ValueError(
                f"query heads ({query.shape[1]}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        self._check_counts(counts, query.shape[2])
        c = self.config
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        if c.pre_rope:  # the model's RoPE scales keys by attention_scaling; ours are rotated here
            scale *= self.rope_scaling
        extras = self.layer_extras(layer_idx, attend=True)
        args = (query, *self.layer_buffers(layer_idx), counts, c.k_bits, c.v_bits, c.group_size, c.residual_length, scale)
        pool = self.pool_buffers(layer_idx)
        if pool:
            if self.impl == "op":
                return torch.ops.kivi.cache_attend_pool(query, *self.layer_buffers(layer_idx), *pool, *args[10:], *extras)
            return _decomposed().cache_attend_decomposed(*args, form=self.attend_form, pool=pool, extras=extras)
        if self.impl == "op":
            return torch.ops.kivi.cache_attend(*args, *extras)
        return _decomposed().cache_attend_decomposed(*args, form=self.attend_form, extras=extras)

    def use_impl(self, impl: str, attend_form: str = "auto") -> "KIVICache":
        """impl "op": the kivi custom ops (eager, compile, pt2, AOTInductor). "decomposed": the same
        math in core ATen ops (decomposed.py), for exporters that cannot carry custom ops (ONNX,
        ExecuTorch) and for Inductor on CPU, which fuses it into loops over the packed codes.
        attend_form (decomposed only): "auto", "fused" or "materialized" (see decomposed.py)."""
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if attend_form not in ATTEND_FORMS:
            raise ValueError(f"attend_form must be one of {ATTEND_FORMS}, got {attend_form!r}")
        self.impl, self.attend_form = impl, attend_form
        return self

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, max length, head_dim] exactly as attention sees them
        (dequantized where quantized, exact from the residual); zeros past a sequence's length."""
        from .cache_reference import materialize_block

        self._check_layer(layer_idx)
        bufs = self.layer_buffers(layer_idx)
        lengths = bufs[-1]
        stop = int(lengths.max())
        c = self.config
        extras = self.layer_extras(layer_idx, attend=True)
        keys, values = materialize_block(*bufs, 0, stop, c.k_bits, c.v_bits, c.group_size, c.residual_length, extras)
        pool = self.pool_buffers(layer_idx)
        if pool:  # pooled tokens are seen exact
            pool_k, pool_v, pool_pos = pool
            for b, h, i in (pool_pos >= 0).nonzero().tolist():
                t = int(pool_pos[b, h, i])
                keys[b, h, t], values[b, h, t] = pool_k[b, h, i].float(), pool_v[b, h, i].float()
        if c.pre_rope:  # as attention sees them: rotated, with the model's attention_scaling
            keys = rope_at(keys, torch.arange(stop, device=keys.device), self.rope_inv_freq) * self.rope_scaling
        inside = (torch.arange(stop, device=lengths.device)[None, :] < lengths[:, None])[:, None, :, None]
        zero = torch.zeros((), device=keys.device)
        return torch.where(inside, keys, zero).to(self.dtype), torch.where(inside, values, zero).to(self.dtype)
