"""The paged KIVI cache: a pool of quantized pages per layer and one block table for the whole
cache (docs/cache.md, "The paged cache"). Host code hands out the pages; the layers never allocate
and give the static layer's numbers bit for bit."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..ops import paged as paged_ops  # noqa: F401  registers torch.ops.kivi.paged_*
from .static import StaticCacheBase, _check_num_layers
from ..config import KIVIConfig
from ..devices import resolve_device, same_device
from .layer import (CacheLayer, dequantized_state, init_constants, option_constants, reserve_for_compiled_steps,
                    run_append, run_attend)
from ..layout import LayerTensors, QuantParams
from ..kernels.reference.packing import packed_bytes
from ..paged_layout import (BLOCK_TABLE_DTYPE, PAGED_TENSORS, ROW_TENSORS, Paging, check_page_size, pages_final,
                            pages_needed, static_view)
from ..options.rotation import rotate, unrotate
from .step import DECODE, Step

__all__ = ["PagedKIVILayer", "PagedKIVICache", "pages_needed"]


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_paged_config(config: KIVIConfig) -> None:
    if not isinstance(config, KIVIConfig):
        raise TypeError(f"config must be a KIVIConfig, got {type(config).__name__}")
    if config.sink_tokens:
        raise ValueError(f"the paged KIVI cache does not support sink tokens (sink_tokens={config.sink_tokens}, "
                         "--sink-tokens); use the static cache")
    if config.outlier_tokens:
        raise ValueError(f"the paged KIVI cache does not support OTT outlier tokens (outlier_tokens="
                         f"{config.outlier_tokens}, --outlier-tokens); use the static cache")
    if config.sparse_outliers:
        raise ValueError(f"the paged KIVI cache does not support the dense-and-sparse store (sparse_outliers="
                         f"{config.sparse_outliers}, --sparse-outliers); use the static cache")
    if config.flush_policy != "kivi":
        raise ValueError(f"the paged KIVI cache supports flush_policy='kivi' only (--flush-policy kivi), got "
                         f"{config.flush_policy!r}; use the static cache")


class PagedKIVILayer(CacheLayer):
    """One layer of the paged KIVI cache; block_table is the cache's shared table (a layer built alone
    gets its own zeros). layer_idx, rope, portable: as KIVILayer."""

    def __init__(self, config: KIVIConfig, layer_idx: int, *, batch_size: int, num_pages: int, page_size: int,
                 max_pages_per_seq: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device="cpu", block_table: Optional[torch.Tensor] = None,
                 rope: Optional[tuple[torch.Tensor, float]] = None, portable: bool = False):
        check_paged_config(config)
        config = config.for_layer(layer_idx)
        for name, value in (("num_pages", num_pages), ("max_pages_per_seq", max_pages_per_seq)):
            _positive_int(name, value)
        _positive_int("page_size", page_size)
        check_page_size(page_size, config.group_size)
        device = resolve_device(device)
        super().__init__(batch_size=batch_size, max_seq_len=max_pages_per_seq * page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device)
        config.check_head_dim(head_dim)
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
        B, H, D, PS = batch_size, num_kv_heads, head_dim, page_size
        R, G = config.residual_length, config.group_size
        gv = config.value_group_size(D)
        N = num_pages + 1
        RR = min(R, self.max_seq_len)
        for name, shape, dt in (
            ("k_codes", (N, H, PS, packed_bytes(D, config.k_bits)), torch.uint8),
            ("k_scale", (N, H, PS // G, D), dtype),
            ("k_zero", (N, H, PS // G, D), dtype),
            ("k_res", (B, H, RR, D), dtype),
            ("v_codes", (N, H, PS, packed_bytes(D, config.v_bits)), torch.uint8),
            ("v_scale", (N, H, PS, D // gv), dtype),
            ("v_zero", (N, H, PS, D // gv), dtype),
            ("v_res", (B, H, RR, D), dtype),
        ):
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)
        self.block_table = _check_block_table(block_table, B, max_pages_per_seq, device)
        self.params = QuantParams(config.k_bits, config.v_bits, G, R)
        init_constants(self, config, layer_idx, rope, device)
        self.portable = bool(portable)
        reserve_for_compiled_steps(device, B)


    @property
    def pages(self) -> Paging:
        return Paging(self.block_table, self.page_size)

    def tensors(self) -> LayerTensors:
        levels = self.levels
        return LayerTensors(
            self.k_codes, self.k_scale, self.k_zero, self.k_res, self.v_codes, self.v_scale, self.v_zero, self.v_res,
            self.lengths, *(None,) * 7, *((levels.k, levels.v) if levels is not None else (None, None)),
            self.rope_inv_freq)


    def append(self, key: torch.Tensor, value: torch.Tensor, step: Step = DECODE) -> None:
        """KIVILayer.append; row b must hold pages_needed(lengths[b] + counts[b]) pages (checked eagerly)."""
        self._check_append(key, value, step.counts)
        if not torch.compiler.is_compiling():
            self.check_pages(key.shape[2], step.counts)
        key, value = rotate(key, self.rot_k), rotate(value, self.rot_v)
        run_append(self.tensors(), key, value, step.counts, self.params, portable=self.portable, pages=self.pages)

    def attend(self, query: torch.Tensor, step: Step = DECODE, scale: Optional[float] = None) -> torch.Tensor:
        self._check_attend(query, step.counts)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        scale *= self.rope_scaling
        out = run_attend(rotate(query, self.rot_k), self.tensors(), step.counts, self.params, scale,
                         portable=self.portable, pages=self.pages)
        return unrotate(out, self.rot_v)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantized_state(self, static_view(self.tensors(), self.block_table))

    def reset(self) -> None:
        """Empty every sequence; the block table (the block manager's) and the constants stay."""
        constants = {id(t) for t in self.constants()}
        for buf in self.buffers(recurse=False):
            if id(buf) not in constants:
                buf.zero_()

    def constants(self) -> list[torch.Tensor]:
        return option_constants(self)

    def page_tensors(self) -> dict[str, torch.Tensor]:
        """The page pools, dim 0 the page id: copy t[page_ids] out, index_copy_ back."""
        return {name: getattr(self, name) for name in PAGED_TENSORS}

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """The per-sequence buffers, dim 0 the batch row: k_res, v_res, lengths."""
        return {name: getattr(self, name) for name in ROW_TENSORS}

    def page_nbytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.page_tensors().values())

    def row_nbytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.row_tensors().values())


    def check_pages(self, n: int, counts: Optional[torch.Tensor] = None) -> None:
        """Raise before writing if a row appending n tokens needs a page id outside [0, num_pages) (a host sync)."""
        self._check_counts_tensor(counts)
        lengths = self.lengths.tolist()
        added = [n] * self.batch_size if counts is None else counts.tolist()
        table = self.block_table.tolist()
        R = self.params.residual_length
        for b, (L, c) in enumerate(zip(lengths, added)):
            if c == 0:
                continue
            need = min(pages_needed(L + c, self.page_size, R), self.max_pages_per_seq)
            bad = [j for j in range(need) if not 0 <= table[b][j] < self.num_pages]
            if bad:
                raise ValueError(
                    f"block_table row {b} must give pages 0..{need - 1} (pages_needed({L + c}, page_size="
                    f"{self.page_size}, residual_length={R}) = {need}) as ids in [0, num_pages={self.num_pages}); "
                    f"page {bad[0]} is {table[b][bad[0]]}")

    def check_room(self, n: int, counts: Optional[torch.Tensor] = None) -> None:
        super().check_room(n, counts)
        self.check_pages(n, counts)


def _check_block_table(block_table, batch_size: int, max_pages: int, device) -> torch.Tensor:
    if block_table is None:
        return torch.zeros((batch_size, max_pages), dtype=BLOCK_TABLE_DTYPE, device=device)
    if (not isinstance(block_table, torch.Tensor) or block_table.shape != (batch_size, max_pages)
            or block_table.dtype != BLOCK_TABLE_DTYPE or not same_device(block_table.device, device)):
        raise ValueError(f"block_table must be an int32 tensor [batch_size={batch_size}, max_pages_per_seq="
                         f"{max_pages}] on {device}, got {getattr(block_table, 'dtype', block_table)} "
                         f"{list(getattr(block_table, 'shape', []))} on {getattr(block_table, 'device', None)}")
    return block_table


class PagedKIVICache(StaticCacheBase):
    """The paged KIVI cache: one PagedKIVILayer per model layer, all reading `block_table`; each layer
    has its own pool, and a page id names the same page in every layer."""

    def __init__(self, config: KIVIConfig, *, num_layers: int, batch_size: int, num_pages: int, page_size: int,
                 max_pages_per_seq: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", rope_inv_freq: Optional[torch.Tensor] = None,
                 rope_scaling: float = 1.0, portable: bool = False):
        check_paged_config(config)
        _check_num_layers(num_layers)
        config.check_num_layers(num_layers)
        _positive_int("batch_size", batch_size)
        _positive_int("max_pages_per_seq", max_pages_per_seq)
        device = resolve_device(device)
        table = torch.zeros((batch_size, max_pages_per_seq), dtype=BLOCK_TABLE_DTYPE, device=device)
        rope = None if rope_inv_freq is None else (rope_inv_freq, rope_scaling)
        layers = [PagedKIVILayer(config, i, batch_size=batch_size, num_pages=num_pages, page_size=page_size,
                                 max_pages_per_seq=max_pages_per_seq, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 dtype=dtype, device=device, block_table=table, rope=rope, portable=portable)
                  for i in range(num_layers)]
        super().__init__(layers)
        self.register_buffer("block_table", table, persistent=False)
        self.config = config

    @property
    def num_pages(self) -> int:
        return self.layers[0].num_pages

    @property
    def page_size(self) -> int:
        return self.layers[0].page_size

    @property
    def max_pages_per_seq(self) -> int:
        return self.layers[0].max_pages_per_seq

    def pages_needed(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size, self.config.residual_length)

    def pages_final(self, num_tokens: int) -> int:
        return pages_final(num_tokens, self.page_size, self.config.residual_length)

    def page_nbytes(self) -> int:
        return sum(layer.page_nbytes() for layer in self.layers)

    def _apply(self, fn, *args, **kwargs):
        """Moving the cache moves the block table once and points every layer at the moved tensor."""
        super()._apply(fn, *args, **kwargs)
        for layer in self.layers:
            layer.block_table = self.block_table
        return self

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def load_row(self, row: int, source: "StaticCacheBase", source_row: int = 0) -> None:
        """Make sequence `row` a copy of a same-settings PagedKIVICache's `source_row`, into the pages this
        cache's block table gives `row`."""
        if not isinstance(source, PagedKIVICache) or source.num_layers != self.num_layers:
            raise ValueError("load_row needs a PagedKIVICache of the same settings")
        n = source.pages_needed(int(source.lengths()[source_row]))
        src_ids = source.block_table[source_row, :n].long()
        dst_ids = self.block_table[row, :n].long()
        for mine, theirs in zip(self.layers, source.layers):
            for name, t in mine.row_tensors().items():
                t[row].copy_(theirs.row_tensors()[name][source_row])
            for name, t in mine.page_tensors().items():
                t.index_copy_(0, dst_ids, theirs.page_tensors()[name].index_select(0, src_ids))
