"""The paged cache ops, kivi::paged_append / paged_attend: the static ops' schemas (ops.py) with a
block table [B, M] after the LayerTensors, whose quantized buffers are page pools; the kernels run
the chosen implementation's paged form. The sink/OTT pool and sparse store are refused."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import dispatch
from ..options.extras import check_extras
from ..dispatch import implementations
from ..layout import PARAMS_SCHEMA, LayerTensors, QuantParams, bind_args, layer_schema
from . import APPEND_CHOICE, ATTEND_CHOICE, CHOICE_DEFAULTS, check_tune
from ..paged_layout import Paging, check_paged_layer

torch.library.define(
    "kivi::paged_append",
    f"({layer_schema(True)}, Tensor block_table, Tensor key, Tensor value, Tensor? counts, {PARAMS_SCHEMA}, "
    f"{APPEND_CHOICE}) -> ()")
torch.library.define(
    "kivi::paged_attend",
    f"(Tensor query, {layer_schema(False)}, Tensor block_table, Tensor? counts, {PARAMS_SCHEMA}, float scale, "
    f"{ATTEND_CHOICE}) -> Tensor")

_N = len(LayerTensors._fields)
_APPEND_ARGS = (*LayerTensors._fields, "block_table", "key", "value", "counts", *QuantParams._fields, "implementation")
_ATTEND_ARGS = ("query", *LayerTensors._fields, "block_table", "counts", *QuantParams._fields, "scale", "implementation",
                "tune")


def check_paged(layer: LayerTensors, block_table: Tensor, params: QuantParams) -> Paging:
    """The paged layer's tensors and block table, shapes only (no host sync); its Paging."""
    if layer.pool_pos is not None or layer.pool_k is not None or params.sink_tokens or params.outlier_tokens:
        raise ValueError("the paged cache does not support the sink/OTT token pool (sink_tokens, outlier_tokens)")
    if layer.k_sparse is not None or layer.v_sparse is not None:
        raise ValueError("the paged cache does not support the dense-and-sparse store (sparse_outliers)")
    page_size = check_paged_layer(layer, block_table, params.group_size)
    check_extras(layer.extras, layer.k_codes, layer.k_res, params.k_bits, params.v_bits, params.residual_length)
    return Paging(block_table, page_size)


def _append_args(args, kwargs):
    a = bind_args(_APPEND_ARGS, args, kwargs, CHOICE_DEFAULTS)
    layer, block_table, (key, value, counts) = LayerTensors(*a[:_N]), a[_N], a[_N + 1:_N + 4]
    params = QuantParams(*a[_N + 4:-1])
    pages = check_paged(layer, block_table, params)
    return layer, key, value, counts, params, pages, implementations.name("append", a[-1])


def _attend_args(args, kwargs):
    a = bind_args(_ATTEND_ARGS, args, kwargs, CHOICE_DEFAULTS)
    layer, block_table, counts = LayerTensors(*a[1:_N + 1]), a[_N + 1], a[_N + 2]
    params, scale = QuantParams(*a[_N + 3:-3]), a[-3]
    pages = check_paged(layer, block_table, params)
    check_tune(a[0], a[-1])
    return a[0], layer, counts, params, scale, pages, implementations.name("attend", a[-2]), a[-1]


@torch.library.register_fake("kivi::paged_append")
def _(*args, **kwargs):
    _append_args(args, kwargs)
    return None


@torch.library.register_fake("kivi::paged_attend")
def _(*args, **kwargs):
    return torch.empty_like(_attend_args(args, kwargs)[0])


def _append_kernel(*args, **kwargs) -> None:
    layer, key, value, counts, params, pages, implementation = _append_args(args, kwargs)
    implementations.form("append", implementation, paged=True)(layer, key, value, counts, params, pages)


def _attend_kernel(*args, **kwargs) -> Tensor:
    query, layer, counts, params, scale, pages, implementation, tune = _attend_args(args, kwargs)
    if tune:
        return dispatch.tuned_attend(implementation, query, layer, counts, params, scale, pages=pages)
    return implementations.form("attend", implementation, paged=True)(query, layer, counts, params, scale, pages)


for _device in ("cpu", "cuda"):
    torch.library.impl("kivi::paged_append", _device)(_append_kernel)
    torch.library.impl("kivi::paged_attend", _device)(_attend_kernel)
