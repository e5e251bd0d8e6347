"""The paged cache ops, `torch.ops.kivi.paged_append` / `paged_attend`: each schema declared once,
its fake kernel beside it (as ops.py for the static cache ops).

    kivi::paged_append(<LayerTensors, mutated>, block_table, key, value, counts?, <QuantParams>) -> ()
    kivi::paged_attend(query, <LayerTensors>, block_table, counts?, <QuantParams>, scale) -> out

The LayerTensors bundle is the static ops' (layout.py), its six quantized buffers being page pools
(paged_layout.py); the block table [B, M] follows it. The page size is the pools' dim 2. The
device kernels ask dispatch.py which implementation runs, as the static ops' do.

Options: nuq levels and pre-RoPE keys work as in the static cache (they do not depend on where
a token's codes live). The sink/OTT pool and the dense-and-sparse store are refused here (the
layer refuses their flags when it is built).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .extras import check_extras
from .layout import LayerTensors, QuantParams
from .ops import _PARAMS, _bind, _layer_schema
from .paged_layout import Paging, check_paged_layer

torch.library.define(
    "kivi::paged_append",
    f"({_layer_schema(True)}, Tensor block_table, Tensor key, Tensor value, Tensor? counts, {_PARAMS}) -> ()")
torch.library.define(
    "kivi::paged_attend",
    f"(Tensor query, {_layer_schema(False)}, Tensor block_table, Tensor? counts, {_PARAMS}, float scale) -> Tensor")

_N = len(LayerTensors._fields)
_APPEND_ARGS = (*LayerTensors._fields, "block_table", "key", "value", "counts", *QuantParams._fields)
_ATTEND_ARGS = ("query", *LayerTensors._fields, "block_table", "counts", *QuantParams._fields, "scale")


def check_paged(layer: LayerTensors, block_table: Tensor, params: QuantParams) -> Paging:
    """The paged layer's tensors and block table (shapes only: no host sync); its Paging."""
    if layer.pool_pos is not None or layer.pool_k is not None or params.sink_tokens or params.outlier_tokens:
        raise ValueError("the paged cache does not support the sink/OTT token pool (sink_tokens, outlier_tokens)")
    if layer.k_sparse is not None or layer.v_sparse is not None:
        raise ValueError("the paged cache does not support the dense-and-sparse store (sparse_outliers)")
    page_size = check_paged_layer(layer, block_table, params.group_size)
    check_extras(layer.extras, layer.k_codes, layer.k_res, params.k_bits, params.v_bits, params.residual_length)
    return Paging(block_table, page_size)


def _append_args(args, kwargs):
    """(layer, key, value, counts, params, pages) from paged_append's arguments, checked."""
    a = _bind(_APPEND_ARGS, args, kwargs)
    layer, block_table, (key, value, counts) = LayerTensors(*a[:_N]), a[_N], a[_N + 1:_N + 4]
    params = QuantParams(*a[_N + 4:])
    return layer, key, value, counts, params, check_paged(layer, block_table, params)


def _attend_args(args, kwargs):
    """(query, layer, counts, params, scale, pages) from paged_attend's arguments, checked."""
    a = _bind(_ATTEND_ARGS, args, kwargs)
    layer, block_table, counts = LayerTensors(*a[1:_N + 1]), a[_N + 1], a[_N + 2]
    params, scale = QuantParams(*a[_N + 3:-1]), a[-1]
    return a[0], layer, counts, params, scale, check_paged(layer, block_table, params)


@torch.library.register_fake("kivi::paged_append")
def _(*args, **kwargs):
    _append_args(args, kwargs)
    return None


@torch.library.register_fake("kivi::paged_attend")
def _(*args, **kwargs):
    return torch.empty_like(_attend_args(args, kwargs)[0])


def _append_kernel(*args, **kwargs) -> None:
    """CPU and CUDA kernel of paged_append (dispatch.py: the reference on CPU, Triton on CUDA)."""
    layer, key, value, counts, params, pages = _append_args(args, kwargs)
    choice = dispatch.choose("append", device=key.device.type, mode="eager", q_len=key.shape[2], layer=layer,
                             cpu_kernels="reference")
    dispatch.run_append(choice.implementation, layer, key, value, counts, params, pages=pages)


def _attend_kernel(*args, **kwargs) -> Tensor:
    """CPU and CUDA kernel of paged_attend."""
    query, layer, counts, params, scale, pages = _attend_args(args, kwargs)
    return dispatch.attend_in_op(query, layer, counts, params, scale, pages=pages)


for _device in ("cpu", "cuda"):
    torch.library.impl("kivi::paged_append", _device)(_append_kernel)
    torch.library.impl("kivi::paged_attend", _device)(_attend_kernel)
