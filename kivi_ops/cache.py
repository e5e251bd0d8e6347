"""KIVICache: a preallocated, static-shape KV cache stored the KIVI way.

`KIVICache.layers` is a list of per-layer modules (layer.py: the nine KIVI buffers, and the
sink/OTT pool, sparse store and nuq levels as sub-modules when on). append / attend hand a layer
to the two cache ops as one LayerTensors bundle; dispatch.py decides which implementation runs.
Ops always receive whole buffers, so a compiled decode step updates them in place without copies.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import dispatch, ops  # noqa: F401  (ops registers torch.ops.kivi, which dispatch calls)
from .config import KIVIConfig
from .kernels.reference import check_capacity, materialize_block
from .layer import KIVILayer
from .layout import LayerTensors
from .packing import FLOAT_DTYPES
from .rope import rope_at


def fp16_cache_nbytes(*, num_layers: int, batch_size: int, num_tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of an unquantized fp16 K+V cache holding num_tokens tokens per sequence."""
    return 2 * num_layers * batch_size * num_kv_heads * num_tokens * head_dim * 2


class StaticCacheBase(nn.Module):
    """What every static cache here shares: dimensions, `layers` (one module per layer, each with a
    `lengths` buffer), byte accounting, the state an exported program carries."""

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
        # Built for an exporter that cannot carry custom ops (ONNX, ExecuTorch): dispatch.py's
        # "portable" mode (core ATen forms only). Set by kivi_export.
        self.portable = False

    @property
    def device(self) -> torch.device:
        return self.layers[0].lengths.device

    def lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens stored per sequence (a device tensor; no sync)."""
        return self.layers[layer_idx].lengths

    def reset(self) -> None:
        """Empty every sequence (constants stay)."""
        for layer in self.layers:
            layer.reset()

    def restart_rows(self, fresh: torch.Tensor) -> None:
        """Rows where fresh [B] is True start new sequences (inside a graph: no host sync)."""
        for layer in self.layers:
            layer.restart_rows(fresh)

    def constants(self) -> list[torch.Tensor]:
        """Buffers that hold constants, not sequence state (none here)."""
        return []

    def state(self) -> dict[str, torch.Tensor]:
        """The sequence state by buffer name: what an exported program without mutable state
        (ONNX) takes in and gives back each call. Constants stay inside the program."""
        constants = {id(t) for t in self.constants()}
        return {name: t for name, t in self.named_buffers() if id(t) not in constants}

    def load_row(self, row: int, source: "StaticCacheBase", source_row: int = 0) -> None:
        """Make sequence `row` a copy of `source`'s sequence `source_row` (a cache of the same kind
        and settings, any batch size): every state buffer is batch-first. The other rows are
        untouched. A server prefills a request in a batch-1 cache and loads it into a free row, so
        an admission costs the prompt alone, not a forward over every row."""
        mine, theirs = self.state(), source.state()
        if mine.keys() != theirs.keys():
            raise ValueError("load_row needs a cache of the same kind and options")
        for name, t in mine.items():
            src = theirs[name]
            if t.shape[1:] != src.shape[1:]:
                raise ValueError(f"load_row: {name} has shape {list(src.shape)}, this cache {list(t.shape)}")
            t[row].copy_(src[source_row])

    def fp16_nbytes(self, num_tokens: Optional[int] = None) -> int:
        """Bytes an fp16 K+V cache would need for num_tokens (default max_seq_len) per sequence."""
        return fp16_cache_nbytes(
            num_layers=self.num_layers, batch_size=self.batch_size,
            num_tokens=self.max_seq_len if num_tokens is None else num_tokens,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        )

    # counts, shared by every static cache (KIVICache, FPCache)

    def _check_counts_tensor(self, counts: Optional[torch.Tensor], device: torch.device) -> None:
        """counts' type, shape, dtype and device (no host sync)."""
        if counts is None:
            return
        want = f"counts must be an int64 tensor of shape [{self.batch_size}] on {device} (or None)"
        if not isinstance(counts, torch.Tensor):
            raise ValueError(f"{want} (e.g. torch.tensor([...], device=...)), got {type(counts).__name__} {counts!r}")
        if counts.shape != (self.batch_size,) or counts.dtype != torch.int64 or counts.device != device:
            raise ValueError(f"{want}, got {counts.dtype} {list(counts.shape)} on {counts.device}")

    def _check_counts(self, counts: Optional[torch.Tensor], n: int, device: torch.device) -> None:
        self._check_counts_tensor(counts, device)
        if counts is None:
            return
        if not torch.compiler.is_compiling() and bool(((counts < 0) | (counts > n)).any()):
            raise ValueError(f"counts must lie in [0, {n}] (the number of new tokens), got {counts.tolist()}")


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
        device = torch.device(device)
        self.layers = nn.ModuleList(
            KIVILayer(config, layer, batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, dtype=dtype, device=device)
            for layer in range(num_layers))
        if config.pre_rope:
            self.register_buffer("rope_inv_freq", rope_inv_freq.detach().to(device=device, dtype=torch.float32).clone(),
                                 persistent=False)
        else:
            self.rope_inv_freq = None

    def check_room(self, n: int, counts: Optional[torch.Tensor] = None, layer_idx: int = 0) -> None:
        """Raise before anything is written if appending n tokens (counts[b] for row b) would grow a
        sequence past max_seq_len (a host sync). Compiled appends cannot raise (the CPU's
        decomposed form and the CUDA kernels do not check); a compiled loop calls this first."""
        self._check_counts_tensor(counts, self.device)
        check_capacity(self.lengths(layer_idx), counts, n, self.max_seq_len)

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        """Store key/value [batch, kv_heads, n, head_dim] in layer `layer_idx`. Row b's first
        counts[b] tokens are real (right padding), the rest are never stored. counts: None (all n
        tokens of every row) or an int64 tensor [batch] on the cache's device (a list raises
        ValueError). Raises before
        writing if a sequence would exceed max_seq_len (in eager mode and in compiled mode on CPU;
        the CUDA kernel drops tokens past capacity instead, since it cannot raise inside a CUDA
        graph)."""
        self._check_layer(layer_idx)
        self.append_to(self.layers[layer_idx], key, value, counts)

    def attend(self, layer_idx: int, query: torch.Tensor, scale: Optional[float] = None,
               counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of query [batch, q_heads, q_len, head_dim] over layer `layer_idx` (quantized
        part + residual, one softmax, GQA, causal for q_len > 1: the queries' own keys must already be
        appended). counts marks the real queries of right-padded rows, as in append: query i of
        row b sits at position lengths[b] - counts[b] + i and sees the keys at positions up to
        its own.

        Defined for any state of the cache: an output row is zeros when its query sees no key,
        that is for padding rows (i >= counts[b]), for every row of an empty sequence (attend
        before any append, after reset() or restart_rows()), and for queries placed before a
        sequence's first token (counts[b], or q_len without counts, above lengths[b]). Never NaN."""
        self._check_layer(layer_idx)
        return self.attend_to(self.layers[layer_idx], query, scale, counts)

    def layer_tensors(self, layer_idx: int) -> LayerTensors:
        """One layer as the cache ops take it."""
        return self.layers[layer_idx].tensors(self.rope_inv_freq)

    def constants(self) -> list[torch.Tensor]:
        """The nuq levels and RoPE frequencies: reset keeps them, exports embed them."""
        rope = [self.rope_inv_freq] if self.rope_inv_freq is not None else []
        return [t for layer in self.layers for t in layer.constants()] + rope

    def nbytes(self) -> int:
        """Exact bytes held: codes + scales + zeros + residual buffers + lengths, the sink /
        outlier pools (keys, values, positions) and KVQuant's parts (sparse outlier values and
        indices, nuq levels, RoPE frequencies) where the options are on, all layers."""
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    # ------------------------------------------------------------------ checks

    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, {self.num_layers}), got {layer_idx!r}")

    # The checks take the device of the layer at hand rather than self.device (layer 0's): a
    # compiled region that reads layer 0 while appending to layer i would specialize on i.

    def _check_tensor(self, name: str, t: torch.Tensor, heads: Optional[int], device: torch.device) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, tokens, head_dim], got {getattr(t, 'shape', t)}")
        B, H, _, D = t.shape
        if B != self.batch_size or D != self.head_dim or (heads is not None and H != heads):
            want = f"[{self.batch_size}, {heads if heads is not None else 'heads'}, tokens, {self.head_dim}]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{name} must have the cache dtype {self.dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on the cache device {device}, got {t.device}")

    # ------------------------------------------------------------------ ops

    def append_to(self, layer: KIVILayer, key: torch.Tensor, value: torch.Tensor,
                  counts: Optional[torch.Tensor] = None) -> None:
        """append() for one of self.layers given as the module itself: a compiled region shared by
        all layers passes the layer, since an index would be a constant the region specializes on."""
        device = layer.lengths.device
        self._check_tensor("key", key, self.num_kv_heads, device)
        self._check_tensor("value", value, self.num_kv_heads, device)
        if key.shape != value.shape:
            raise ValueError(f"key and value must have the same shape, got {list(key.shape)} and {list(value.shape)}")
        self._check_counts(counts, key.shape[2], device)
        if not torch.compiler.is_compiling():  # compiled forms cannot raise: check here, in eager mode
            check_capacity(layer.lengths, counts, key.shape[2], self.max_seq_len)
        dispatch.append(layer.tensors(self.rope_inv_freq), key, value, counts, layer.params, portable=self.portable)

    def attend_to(self, layer: KIVILayer, query: torch.Tensor, scale: Optional[float] = None,
                  counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """attend() for one of self.layers given as the module itself (see append_to)."""
        device = layer.lengths.device
        self._check_tensor("query", query, None, device)
        if query.shape[1] % self.num_kv_heads:
            raise ValueError(
                f"query heads ({query.shape[1]}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        self._check_counts(counts, query.shape[2], device)
        c = self.config
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        if c.pre_rope:  # the model's RoPE scales keys by attention_scaling; ours are rotated here
            scale *= self.rope_scaling
        return dispatch.attend(query, layer.tensors(self.rope_inv_freq), counts, layer.params, scale,
                               portable=self.portable)

    def dequantized(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [batch, kv_heads, max length, head_dim] exactly as attention sees them
        (dequantized where quantized, exact from the residual); zeros past a sequence's length."""
        self._check_layer(layer_idx)
        layer = self.layers[layer_idx]
        lengths = layer.lengths
        stop = int(lengths.max())
        c = self.config
        keys, values = materialize_block(self.layer_tensors(layer_idx), 0, stop, layer.params)
        if layer.pool is not None:  # pooled tokens are seen exact
            pool_k, pool_v, pool_pos = layer.pool.k, layer.pool.v, layer.pool.pos
            for b, h, i in (pool_pos >= 0).nonzero().tolist():
                t = int(pool_pos[b, h, i])
                keys[b, h, t], values[b, h, t] = pool_k[b, h, i].float(), pool_v[b, h, i].float()
        if c.pre_rope:  # as attention sees them: rotated, with the model's attention_scaling
            keys = rope_at(keys, torch.arange(stop, device=keys.device), self.rope_inv_freq) * self.rope_scaling
        inside = (torch.arange(stop, device=lengths.device)[None, :] < lengths[:, None])[:, None, :, None]
        zero = torch.zeros((), device=keys.device)
        return torch.where(inside, keys, zero).to(self.dtype), torch.where(inside, values, zero).to(self.dtype)
