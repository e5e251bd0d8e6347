"""The `torch.ops.kivi` custom ops, each schema beside its fake kernel: quantize_pack,
unpack_dequantize, and cache_append / cache_attend, whose schemas come from layout.py's bundles.
Opaque to torch.compile (not `triton_op`): the CPU reference's per-sequence control flow cannot be
traced, and the op stays visible in exported graphs."""

from __future__ import annotations


import torch
from torch import Tensor

from .. import dispatch
from ..config import check_axis, check_bits, check_group_size
from ..options.extras import check_extras
from ..dispatch import implementations
from ..layout import PARAMS_SCHEMA, LayerTensors, QuantParams, bind_args, layer_schema
from ..options.schedule import OTT, check_policy_id, residual_slots
from ..kernels.reference.packing import (FLOAT_DTYPES, codes_per_word, packed_bytes, quantize_pack_reference,
                                         token_group_size, unpack_dequantize_reference, word_bytes)


def check_quantize_args(x: Tensor, bits: int, group_size: int, axis: str) -> None:
    check_bits("bits", bits)
    check_group_size("group_size", group_size)
    check_axis(axis)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., T, D] (at least 2 dims), got {tuple(x.shape)}")
    T, D = x.shape[-2], x.shape[-1]
    # Zero tokens give empty outputs; a zero-size head dim has no channel to pack.
    if D == 0:
        raise ValueError(f"x's last dim (head dim) must be positive, got D=0 (shape {tuple(x.shape)})")
    if D % codes_per_word(bits):
        raise ValueError(f"x's last dim D={D} must be a multiple of {codes_per_word(bits)} to pack {bits}-bit codes")
    if axis == "channel" and T % group_size:
        raise ValueError(
            f"axis='channel' groups {group_size} consecutive tokens: x's token dim T={T} must be a "
            f"multiple of group_size={group_size} (pad or keep the remainder in full precision)"
        )
    if axis == "token" and D % token_group_size(group_size, D):
        raise ValueError(f"axis='token' needs head dim D={D} to be a multiple of group_size={group_size}")
    if axis == "token" and token_group_size(group_size, D) % codes_per_word(bits):
        raise ValueError(f"axis='token' at {bits} bits packs {codes_per_word(bits)} codes per word: group_size="
                         f"{group_size} must be a multiple of {codes_per_word(bits)} (a group holds whole words)")


def _group_shape(shape, group_size: int, axis: str):
    *lead, T, D = shape
    if axis == "channel":
        return (*lead, T // group_size, D)
    return (*lead, T, D // token_group_size(group_size, D))




@torch.library.custom_op("kivi::quantize_pack", mutates_args=())
def quantize_pack(x: Tensor, bits: int, group_size: int, axis: str) -> tuple[Tensor, Tensor, Tensor]:
    check_quantize_args(x, bits, group_size, axis)
    return quantize_pack_reference(x.contiguous(), bits, group_size, axis)


@quantize_pack.register_fake
def _(x, bits, group_size, axis):
    check_quantize_args(x, bits, group_size, axis)
    *lead, T, D = x.shape
    codes = x.new_empty((*lead, T, packed_bytes(D, bits)), dtype=torch.uint8)
    gshape = _group_shape(x.shape, group_size, axis)
    return codes, x.new_empty(gshape), x.new_empty(gshape)


@quantize_pack.register_kernel("cuda")
def _(x, bits, group_size, axis):
    from ..kernels.triton.quant import quantize_pack_triton

    check_quantize_args(x, bits, group_size, axis)
    return quantize_pack_triton(x.contiguous(), bits, group_size, axis)


def check_dequantize_args(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, axis: str) -> None:
    check_bits("bits", bits)
    check_group_size("group_size", group_size)
    check_axis(axis)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 (packed), got {codes.dtype}")
    if codes.dim() < 2:
        raise ValueError(f"codes must have shape [..., T, D * bits / 8] (at least 2 dims), got {tuple(codes.shape)}")
    if codes.shape[-1] == 0:
        raise ValueError(f"codes' last dim must be positive (a zero-size head dim), got shape {tuple(codes.shape)}")
    if scale.dtype not in FLOAT_DTYPES or zero.dtype != scale.dtype:
        raise ValueError(f"scale and zero must share a float dtype, got {scale.dtype} and {zero.dtype}")
    if codes.shape[-1] % word_bytes(bits):
        raise ValueError(f"codes' last dim must be a multiple of {word_bytes(bits)} (bytes of a packed {bits}-bit "
                         f"word), got shape {tuple(codes.shape)}")
    D = codes.shape[-1] // word_bytes(bits) * codes_per_word(bits)
    expected = _group_shape((*codes.shape[:-1], D), group_size, axis)
    if tuple(scale.shape) != expected or tuple(zero.shape) != expected:
        raise ValueError(
            f"scale/zero must have shape {expected} for codes {tuple(codes.shape)} at {bits} bits, "
            f"group_size={group_size}, axis={axis!r}; got {tuple(scale.shape)} and {tuple(zero.shape)}"
        )


@torch.library.custom_op("kivi::unpack_dequantize", mutates_args=())
def unpack_dequantize(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, axis: str) -> Tensor:
    check_dequantize_args(codes, scale, zero, bits, group_size, axis)
    return unpack_dequantize_reference(codes, scale, zero, bits, group_size, axis)


@unpack_dequantize.register_fake
def _(codes, scale, zero, bits, group_size, axis):
    check_dequantize_args(codes, scale, zero, bits, group_size, axis)
    D = codes.shape[-1] // word_bytes(bits) * codes_per_word(bits)
    return codes.new_empty((*codes.shape[:-1], D), dtype=scale.dtype)


@unpack_dequantize.register_kernel("cuda")
def _(codes, scale, zero, bits, group_size, axis):
    from ..kernels.triton.quant import unpack_dequantize_triton

    check_dequantize_args(codes, scale, zero, bits, group_size, axis)
    return unpack_dequantize_triton(codes.contiguous(), scale.contiguous(), zero.contiguous(), bits, group_size, axis)



# `implementation` indexes implementations.IMPLEMENTATIONS (the layer's choice); `tune` marks a CUDA
# decode call. A call naming none runs the reference, right on every device.
CHOICE_DEFAULTS = dict(implementation=implementations.index("reference"), tune=False)
APPEND_CHOICE = f"int implementation={CHOICE_DEFAULTS['implementation']}"
ATTEND_CHOICE = f"{APPEND_CHOICE}, bool tune=False"
torch.library.define(
    "kivi::cache_append",
    f"({layer_schema(True)}, Tensor key, Tensor value, Tensor? counts, {PARAMS_SCHEMA}, {APPEND_CHOICE}) -> ()")
torch.library.define(
    "kivi::cache_attend",
    f"(Tensor query, {layer_schema(False)}, Tensor? counts, {PARAMS_SCHEMA}, float scale, {ATTEND_CHOICE}) -> Tensor")

_N = len(LayerTensors._fields)
_APPEND_ARGS = (*LayerTensors._fields, "key", "value", "counts", *QuantParams._fields, "implementation")
_ATTEND_ARGS = ("query", *LayerTensors._fields, "counts", *QuantParams._fields, "scale", "implementation", "tune")


def _append_args(args, kwargs):
    a = bind_args(_APPEND_ARGS, args, kwargs, CHOICE_DEFAULTS)
    layer, (key, value, counts), params = LayerTensors(*a[:_N]), a[_N:_N + 3], QuantParams(*a[_N + 3:-1])
    check_layer(layer, params)
    return layer, key, value, counts, params, implementations.name("append", a[-1])


def _attend_args(args, kwargs):
    a = bind_args(_ATTEND_ARGS, args, kwargs, CHOICE_DEFAULTS)
    layer, counts, params, scale = LayerTensors(*a[1:_N + 1]), a[_N + 1], QuantParams(*a[_N + 2:-3]), a[-3]
    check_layer(layer, params)
    check_tune(a[0], a[-1])
    return a[0], layer, counts, params, scale, implementations.name("attend", a[-2]), a[-1]


def check_tune(query: Tensor, tune: bool) -> None:
    if tune and (query.device.type != "cuda" or query.shape[2] != 1):
        raise ValueError(f"tune=True is for CUDA decode calls (a query with q_len 1 on a CUDA device), got a "
                         f"{query.device.type} query with q_len {query.shape[2]}")


def check_layer(layer: LayerTensors, params: QuantParams) -> None:
    """The optional parts against the KIVI tensors, without reading values (a host sync in CUDA graphs)."""
    check_policy_id(params.flush_policy)
    W = min(residual_slots(params.flush_policy, params.residual_length, params.group_size), layer.k_codes.shape[2])
    if layer.k_res.shape[2] != W or layer.v_res.shape[2] != W:
        raise ValueError(f"k_res/v_res must hold {W} residual rows for flush_policy={params.flush_policy} (R="
                         f"{params.residual_length}, G={params.group_size}, max_seq_len={layer.k_codes.shape[2]}), "
                         f"got {layer.k_res.shape[2]} and {layer.v_res.shape[2]}")
    if params.flush_policy == OTT and layer.k_sparse is not None:
        raise ValueError("the dense-and-sparse store (k_sparse) is not supported with the ott flush policy")
    pool = (layer.pool_k, layer.pool_v, layer.pool_pos)
    if any(t is not None for t in pool):
        if any(t is None for t in pool):
            raise ValueError("pool_k, pool_v and pool_pos must be given together")
        check_pool(*pool, layer.k_res, params.sink_tokens, params.outlier_tokens)
    elif params.sink_tokens or params.outlier_tokens:
        raise ValueError(f"sink_tokens={params.sink_tokens} / outlier_tokens={params.outlier_tokens} need a pool "
                         "(pool_k, pool_v, pool_pos)")
    check_extras(layer.extras, layer.k_codes, layer.k_res, params.k_bits, params.v_bits, params.residual_length)


def check_pool(pool_k: Tensor, pool_v: Tensor, pool_pos: Tensor, k_res: Tensor, sink_tokens: int,
               outlier_tokens: int) -> None:
    B, H, _, D = k_res.shape
    P = pool_pos.shape[-1] if pool_pos.dim() == 3 else -1
    if tuple(pool_k.shape) != (B, H, P, D) or tuple(pool_v.shape) != (B, H, P, D) or pool_pos.dtype != torch.int64:
        raise ValueError(f"pool_k/pool_v must be [B, H, P, D] = {(B, H, P, D)} and pool_pos int64 [B, H, P]; got "
                         f"{tuple(pool_k.shape)}, {tuple(pool_v.shape)}, {pool_pos.dtype} {tuple(pool_pos.shape)}")
    if pool_k.dtype != k_res.dtype or pool_v.dtype != k_res.dtype:
        raise ValueError(f"pool_k/pool_v must have the cache dtype {k_res.dtype}")
    for name, v in (("sink_tokens", sink_tokens), ("outlier_tokens", outlier_tokens)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if sink_tokens + outlier_tokens > P:
        raise ValueError(f"the pool has {P} slots, fewer than sink_tokens + outlier_tokens = "
                         f"{sink_tokens} + {outlier_tokens}")


@torch.library.register_fake("kivi::cache_append")
def _(*args, **kwargs):
    _append_args(args, kwargs)
    return None


@torch.library.register_fake("kivi::cache_attend")
def _(*args, **kwargs):
    query = _attend_args(args, kwargs)[0]
    return torch.empty_like(query)


def _append_kernel(*args, **kwargs) -> None:
    layer, key, value, counts, params, implementation = _append_args(args, kwargs)
    implementations.form("append", implementation)(layer, key, value, counts, params)


def _attend_kernel(*args, **kwargs) -> Tensor:
    """The layer's chosen implementation, or for a tuned CUDA decode call the tuner's pick."""
    query, layer, counts, params, scale, implementation, tune = _attend_args(args, kwargs)
    if tune:
        return dispatch.tuned_attend(implementation, query, layer, counts, params, scale)
    return implementations.form("attend", implementation)(query, layer, counts, params, scale)


for _device in ("cpu", "cuda"):
    torch.library.impl("kivi::cache_append", _device)(_append_kernel)
    torch.library.impl("kivi::cache_attend", _device)(_attend_kernel)
