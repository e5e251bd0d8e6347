"""The cache layer: one module per model layer that owns its buffers and runs its append and attend
(KIVILayer here, FPLayer in fp_layer.py; a list of them is a transformers Cache, cache.py).

Each buffer is registered separately and passed whole: slices or shared storage would make
functionalization clone the whole cache every compiled step."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin

from .. import dispatch
from ..config import KIVIConfig
from ..devices import resolve_device
from ..dispatch import implementations
from ..kernels.reference import check_capacity, materialize_block
from ..layout import LayerTensors, QuantParams
from ..paged_layout import Paging
from ..kernels.reference.packing import FLOAT_DTYPES, packed_bytes
from ..options.rope import rope_at
from ..options.rotation import rotate, rotation_matrix, unrotate
from .step import DECODE, Step


def _zeros(shape, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class CacheLayer(nn.Module, CacheLayerMixin):
    """Dimensions, per-row lengths, input checks and transformers' CacheLayerMixin. The checks use this
    layer's own device: a compiled region shared by all layers must not specialize on another layer."""

    is_compileable = True
    is_sliding = False
    pre_rope = False

    def __init__(self, *, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device):
        nn.Module.__init__(self)
        CacheLayerMixin.__init__(self)
        for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16, got {dtype}")
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.is_initialized = True
        self.register_buffer("lengths", _zeros((batch_size,), torch.int64, device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lengths.device


    def restart_rows(self, fresh: torch.Tensor) -> None:
        self.lengths.copy_(torch.where(fresh, torch.zeros_like(self.lengths), self.lengths))

    def check_room(self, n: int, counts: Optional[torch.Tensor] = None) -> None:
        """Raise before writing if appending n tokens would pass max_seq_len (a host sync): compiled
        appends cannot raise, so a compiled loop calls this first."""
        self._check_counts_tensor(counts)
        check_capacity(self.lengths, counts, n, self.max_seq_len)

    def constants(self) -> list[torch.Tensor]:
        """Buffers that hold constants, not sequence state (reset keeps them, exports embed them)."""
        return []

    def nbytes(self) -> int:
        """Bytes held by the layer's buffers, except the rotation matrices (a model constant, like a weight)."""
        rotations = {id(t) for t in rotation_constants(self)}
        return sum(buf.numel() * buf.element_size() for buf in self.buffers() if id(buf) not in rotations)

    def page_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """Sequence-state buffers whose dim 0 is the batch row (what a swap copies per sequence)."""
        constants = {id(t) for t in self.constants()}
        return {name: t for name, t in self.named_buffers() if id(t) not in constants}


    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.append(key_states, value_states)
        return self.dequantized()

    def get_seq_length(self) -> int:
        return int(self.lengths.max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.max_seq_len


    def _check_input(self, name: str, t: torch.Tensor, heads: Optional[int]) -> None:
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

    def _check_append(self, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor]) -> None:
        self._check_input("key", key, self.num_kv_heads)
        self._check_input("value", value, self.num_kv_heads)
        if key.shape != value.shape:
            raise ValueError(f"key and value must have the same shape, got {list(key.shape)} and {list(value.shape)}")
        self._check_counts(counts, key.shape[2])
        if not torch.compiler.is_compiling():  # compiled forms cannot raise: checked here, in eager mode
            check_capacity(self.lengths, counts, key.shape[2], self.max_seq_len)

    def _check_attend(self, query: torch.Tensor, counts: Optional[torch.Tensor]) -> None:
        self._check_input("query", query, None)
        if query.shape[1] % self.num_kv_heads:
            raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self._check_counts(counts, query.shape[2])

    def _check_counts_tensor(self, counts: Optional[torch.Tensor]) -> None:
        if counts is None:
            return
        want = f"counts must be an int64 tensor of shape [{self.batch_size}] on {self.device} (or None)"
        if not isinstance(counts, torch.Tensor):
            raise ValueError(f"{want} (e.g. torch.tensor([...], device=...)), got {type(counts).__name__} {counts!r}")
        if counts.shape != (self.batch_size,) or counts.dtype != torch.int64 or counts.device != self.device:
            raise ValueError(f"{want}, got {counts.dtype} {list(counts.shape)} on {counts.device}")

    def _check_counts(self, counts: Optional[torch.Tensor], n: int) -> None:
        self._check_counts_tensor(counts)
        if counts is not None and not torch.compiler.is_compiling() and bool(((counts < 0) | (counts > n)).any()):
            raise ValueError(f"counts must lie in [0, {n}] (the number of new tokens), got {counts.tolist()}")


class TokenPool(nn.Module):
    def __init__(self, B: int, H: int, P: int, D: int, dtype, device):
        super().__init__()
        self.register_buffer("k", _zeros((B, H, P, D), dtype, device), persistent=False)
        self.register_buffer("v", _zeros((B, H, P, D), dtype, device), persistent=False)
        self.register_buffer("pos", torch.full((B, H, P), -1, dtype=torch.int64, device=device), persistent=False)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.pos.fill_(-1)


class SparseStore(nn.Module):
    def __init__(self, k_shape, v_shape, dtype, device):
        super().__init__()
        self.register_buffer("k", _zeros(k_shape, dtype, device), persistent=False)
        self.register_buffer("k_idx", torch.full(k_shape, -1, dtype=torch.int16, device=device), persistent=False)
        self.register_buffer("v", _zeros(v_shape, dtype, device), persistent=False)
        self.register_buffer("v_idx", torch.full(v_shape, -1, dtype=torch.int16, device=device), persistent=False)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.k_idx.fill_(-1)
        self.v_idx.fill_(-1)


class NuqLevels(nn.Module):
    def __init__(self, key_levels, value_levels, device):
        super().__init__()
        self.register_buffer("k", torch.tensor(key_levels, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v", torch.tensor(value_levels, dtype=torch.float32, device=device), persistent=False)


def reserve_for_compiled_steps(device: torch.device, batch_size: int) -> None:
    """CUDA: allocate the Triton append's arrival counters before any compiled step or graph capture."""
    if device.type == "cuda":
        from ..kernels.triton.append import reserve_arrival_counters

        reserve_arrival_counters(device, batch_size)


def rotation_constants(layer) -> list[torch.Tensor]:
    return [t for t in (getattr(layer, "rot_k", None), getattr(layer, "rot_v", None)) if t is not None]


def option_constants(layer) -> list[torch.Tensor]:
    levels = [layer.levels.k, layer.levels.v] if layer.levels is not None else []
    rope = [layer.rope_inv_freq] if layer.rope_inv_freq is not None else []
    return levels + rope + rotation_constants(layer)


def _calibrated(rotations, part: str, layer: CacheLayer, layer_idx: int) -> torch.Tensor:
    L, H, D, _ = rotations.shape
    if (H, D) != (layer.num_kv_heads, layer.head_dim) or layer_idx >= L:
        raise ValueError(f"rotations ({rotations.source}) are [layers={L}, kv_heads={H}, head_dim={D}], but layer "
                         f"{layer_idx} caches kv_heads={layer.num_kv_heads}, head_dim={layer.head_dim}: calibrate "
                         "this model with `kivi calibrate`")
    return getattr(rotations, part)[layer_idx]


def init_constants(layer: CacheLayer, config: KIVIConfig, layer_idx: int, rope, device) -> None:
    D = layer.head_dim
    for name, kind, part in (("rot_k", config.rotate_keys, "keys"), ("rot_v", config.rotate_values, "values")):
        if kind == "calibrated":
            m = _calibrated(config.rotations, part, layer, layer_idx)
        else:
            m = rotation_matrix(kind, D, config.rotation_seed)
        if m is None:
            setattr(layer, name, None)
        else:
            layer.register_buffer(name, m.to(device), persistent=False)
    layer.levels = (NuqLevels(config.key_levels[layer_idx], config.value_levels[layer_idx], device)
                    if config.has_nuq else None)
    layer.pre_rope = config.pre_rope
    layer.rope_scaling = 1.0
    if config.pre_rope:
        if rope is None or not isinstance(rope[0], torch.Tensor) or rope[0].shape != (D // 2,):
            got = None if rope is None else getattr(rope[0], "shape", rope[0])
            raise ValueError(f"pre_rope=True needs rope_inv_freq, the model's RoPE frequencies [head_dim / 2 = "
                             f"{D // 2}] (kivi_models.make_cache passes them), got {got}")
        inv_freq, layer.rope_scaling = rope[0], float(rope[1])
        layer.register_buffer("rope_inv_freq", inv_freq.detach().to(device=device, dtype=torch.float32).clone(),
                              persistent=False)
    elif rope is not None:
        raise ValueError("rope_inv_freq is only used with pre_rope=True")
    else:
        layer.rope_inv_freq = None


def dequantized_state(layer: CacheLayer, t: LayerTensors) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = layer.lengths
    stop = int(lengths.max())
    keys, values = materialize_block(t, 0, stop, layer.params)
    pool = getattr(layer, "pool", None)
    if pool is not None:
        for b, h, i in (pool.pos >= 0).nonzero().tolist():
            pos = int(pool.pos[b, h, i])
            keys[b, h, pos], values[b, h, pos] = pool.k[b, h, i].float(), pool.v[b, h, i].float()
    if layer.pre_rope:
        keys = rope_at(keys, torch.arange(stop, device=keys.device), layer.rope_inv_freq) * layer.rope_scaling
    keys, values = unrotate(keys, layer.rot_k), unrotate(values, layer.rot_v)
    inside = (torch.arange(stop, device=lengths.device)[None, :] < lengths[:, None])[:, None, :, None]
    zero = torch.zeros((), device=keys.device)
    return torch.where(inside, keys, zero).to(layer.dtype), torch.where(inside, values, zero).to(layer.dtype)


def run_append(layer: LayerTensors, key, value, counts, params: QuantParams, *, portable: bool = False,
               pages: Optional[Paging] = None) -> None:
    """dispatch.choose once, then the kivi op, the traced form or the compiled form it names."""
    choice = dispatch.choose("append", device=key.device.type, mode=dispatch.current_mode(portable), q_len=key.shape[2],
                             layer=layer, cpu_kernels=dispatch.current_cpu_kernels())
    name, paged = choice.implementation, pages is not None
    if choice.in_op and paged:
        torch.ops.kivi.paged_append(*layer, pages.block_table, key, value, counts, *params, implementations.index(name))
    elif choice.in_op:
        torch.ops.kivi.cache_append(*layer, key, value, counts, *params, implementations.index(name))
    elif choice.compiled:
        from ..dispatch import cpu_compiled

        form = implementations.form("append", name, paged)
        cpu_compiled.append(form, layer, key, value, counts, params, pages)
    else:
        implementations.run_append(name, layer, key, value, counts, params, pages=pages)


def run_attend(query, layer: LayerTensors, counts, params: QuantParams, scale: float, *, portable: bool = False,
               pages: Optional[Paging] = None):
    """As run_append; traced code never touches the CUDA tuner or the C++ extension (dispatch.tuned_attend)."""
    choice = dispatch.choose("attend", device=query.device.type, mode=dispatch.current_mode(portable),
                             q_len=query.shape[2], layer=layer, cpu_kernels=dispatch.current_cpu_kernels())
    name, paged = choice.implementation, pages is not None
    if choice.in_op and paged:
        return torch.ops.kivi.paged_attend(query, *layer, pages.block_table, counts, *params, scale,
                                           implementations.index(name), choice.tune)
    if choice.in_op:
        return torch.ops.kivi.cache_attend(query, *layer, counts, *params, scale, implementations.index(name),
                                           choice.tune)
    if choice.compiled:
        from ..dispatch import cpu_compiled

        form = implementations.form("attend", name, paged)
        return cpu_compiled.attend(form, query, layer, counts, params, scale, pages)
    return implementations.run_attend(name, query, layer, counts, params, scale, pages=pages)


class KIVILayer(CacheLayer):
    """One layer of the KIVI cache (layout.py's buffers, options None when off). rope: (inv_freq, attention
    scaling), required with pre_rope; portable: core ATen forms only (ONNX, ExecuTorch)."""

    def __init__(self, config: KIVIConfig, layer_idx: int, *, batch_size: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 rope: Optional[tuple[torch.Tensor, float]] = None, portable: bool = False):
        if not isinstance(config, KIVIConfig):
            raise TypeError(f"config must be a KIVIConfig, got {type(config).__name__}")
        device = resolve_device(device)
        super().__init__(batch_size=batch_size, max_seq_len=max_seq_len, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device)
        config = config.for_layer(layer_idx)
        config.check_head_dim(head_dim)
        B, H, S, D = batch_size, num_kv_heads, max_seq_len, head_dim
        R, G = config.residual_length, config.group_size
        gv = config.value_group_size(D)
        RR = min(config.residual_slots(), S)
        for name, shape, dt in (
            ("k_codes", (B, H, S, packed_bytes(D, config.k_bits)), torch.uint8),
            ("k_scale", (B, H, math.ceil(S / G), D), dtype),
            ("k_zero", (B, H, math.ceil(S / G), D), dtype),
            ("k_res", (B, H, RR, D), dtype),
            ("v_codes", (B, H, S, packed_bytes(D, config.v_bits)), torch.uint8),
            ("v_scale", (B, H, S, D // gv), dtype),
            ("v_zero", (B, H, S, D // gv), dtype),
            ("v_res", (B, H, RR, D), dtype),
        ):
            self.register_buffer(name, _zeros(shape, dt, device), persistent=False)
        P = config.layer_pool_size(layer_idx)
        self.pool: Optional[TokenPool] = TokenPool(B, H, P, D, dtype, device) if P else None
        nk, nv = config.sparse_counts(D)
        self.sparse: Optional[SparseStore] = (
            SparseStore((B, H, S // R * nk, D), (B, H, S, nv), dtype, device) if nv else None)
        self.params = QuantParams(config.k_bits, config.v_bits, G, R, config.sink_tokens if P else 0,
                                  config.layer_outlier_tokens(layer_idx), config.policy_id)
        init_constants(self, config, layer_idx, rope, device)
        self.portable = bool(portable)
        reserve_for_compiled_steps(device, batch_size)

    def tensors(self) -> LayerTensors:
        pool, sparse, levels = self.pool, self.sparse, self.levels
        return LayerTensors(
            self.k_codes, self.k_scale, self.k_zero, self.k_res, self.v_codes, self.v_scale, self.v_zero, self.v_res,
            self.lengths,
            *((pool.k, pool.v, pool.pos) if pool is not None else (None,) * 3),
            *((sparse.k, sparse.k_idx, sparse.v, sparse.v_idx) if sparse is not None else (None,) * 4),
            *((levels.k, levels.v) if levels is not None else (None,) * 2),
            self.rope_inv_freq,
        )

    def append(self, key: torch.Tensor, value: torch.Tensor, step: Step = DECODE) -> None:
        """Store key/value [batch, kv_heads, n, head_dim]; step.counts marks right-padded rows' real tokens.
        Raises past max_seq_len (eager, and compiled on CPU; the CUDA kernel drops the tokens instead)."""
        self._check_append(key, value, step.counts)
        key, value = rotate(key, self.rot_k), rotate(value, self.rot_v)
        run_append(self.tensors(), key, value, step.counts, self.params, portable=self.portable)

    def attend(self, query: torch.Tensor, step: Step = DECODE, scale: Optional[float] = None) -> torch.Tensor:
        """Attention of query [batch, q_heads, q_len, head_dim], causal; query i of row b sits at position
        lengths[b] - counts[b] + i. An output row is zeros when its query sees no key (padding, attend
        before any append, before a sequence's first token); never NaN."""
        self._check_attend(query, step.counts)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        scale *= self.rope_scaling  # pre-RoPE keys: the model's attention_scaling (the op applies RoPE)
        out = run_attend(rotate(query, self.rot_k), self.tensors(), step.counts, self.params, scale,
                         portable=self.portable)
        return unrotate(out, self.rot_v)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as attention sees them in the model's basis, zeros past each length (tests only)."""
        return dequantized_state(self, self.tensors())

    def reset(self) -> None:
        constants = {id(t) for t in self.constants()}
        for buf in self.buffers(recurse=False):
            if id(buf) not in constants:
                buf.zero_()
        for part in (self.pool, self.sparse):
            if part is not None:
                part.reset()

    def restart_rows(self, fresh: torch.Tensor) -> None:
        super().restart_rows(fresh)
        if self.pool is not None:
            pos = self.pool.pos
            pos.copy_(torch.where(fresh[:, None, None], torch.full_like(pos, -1), pos))

    def constants(self) -> list[torch.Tensor]:
        return option_constants(self)
