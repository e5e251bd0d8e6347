"""The vLLM-style paged fp cache, the baseline of the paged KIVI cache: pools k, v [num_pages + 1,
H, page_size, D] over one int32 block table; page num_pages is the null page that unused entries
and padding writes point at, never visible. Pages hold every token (no residual window)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .static import StaticCacheBase, _check_num_layers
from .layer import CacheLayer
from .step import DECODE, Step

DEFAULT_PAGE_SIZE = 16


def pages_needed(num_tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    _check_positive("page_size", page_size)
    return -(-num_tokens // page_size)


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class PagedFPLayer(CacheLayer):
    def __init__(self, *, block_table: torch.Tensor, num_pages: int, page_size: int, batch_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, device="cpu"):
        _check_positive("num_pages", num_pages)
        _check_positive("page_size", page_size)
        max_pages = block_table.shape[1]
        super().__init__(batch_size=batch_size, max_seq_len=max_pages * page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, device=device)
        if block_table.shape != (batch_size, max_pages) or block_table.dtype != torch.int32:
            raise ValueError(f"block_table must be int32 [batch_size={batch_size}, max_pages_per_seq], got "
                             f"{block_table.dtype} {list(block_table.shape)}")
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages
        shape = (num_pages + 1, num_kv_heads, page_size, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # Registered per layer so compiled code takes it as an input; the same tensor in every layer.
        self.register_buffer("block_table", block_table, persistent=False)

    @property
    def null_page(self) -> int:
        return self.num_pages

    def page_tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v}

    def row_tensors(self) -> dict[str, torch.Tensor]:
        return {"lengths": self.lengths}

    def nbytes(self) -> int:
        """Bytes of the pages sequences can use (not the null page, lengths or the block table)."""
        return 2 * self.num_pages * self.num_kv_heads * self.page_size * self.head_dim * self.k.element_size()

    def reset(self) -> None:
        for buf in (self.k, self.v, self.lengths):
            buf.zero_()

    def _check_pages(self, n: int, counts: Optional[torch.Tensor]) -> None:
        """Eager only (a host sync): every real token must land in a page its table row gives."""
        if torch.compiler.is_compiling():
            return
        added = torch.full_like(self.lengths, n) if counts is None else counts
        end = self.lengths + added
        need = (end + self.page_size - 1) // self.page_size
        j = torch.arange(self.max_pages_per_seq, device=self.device)
        table = self.block_table.long()
        need = torch.where(added > 0, need, 0)
        bad = ((j[None, :] < need[:, None]) & ((table < 0) | (table >= self.num_pages))).nonzero()
        if len(bad):
            b, page = (int(x) for x in bad[0])
            raise ValueError(f"row {b} would hold {int(end[b])} tokens but block_table[{b}, {page}] = "
                             f"{int(table[b, page])} is not a page of the pool (0..{self.num_pages - 1}): allocate "
                             f"its pages first")

    def append(self, key: torch.Tensor, value: torch.Tensor, step: Step = DECODE) -> None:
        self._check_append(key, value, step.counts)
        self._check_pages(key.shape[2], step.counts)
        counts, lengths, P = step.counts, self.lengths, self.page_size
        B, H, n, _ = key.shape
        i = torch.arange(n, device=key.device)
        pos = lengths[:, None] + i[None, :]
        real = i[None, :] < (n if counts is None else counts[:, None])
        slot_page = (pos // P).clamp(max=self.max_pages_per_seq - 1)
        page = torch.where(real, self.block_table.long().gather(1, slot_page), self.null_page)
        offset = torch.where(real, pos % P, 0)
        # index_put_ as FPLayer.append (re-inplaced by Inductor); padding lands in the null page.
        idx = (page[:, None, :], torch.arange(H, device=key.device)[None, :, None], offset[:, None, :])
        self.k.index_put_(idx, key)
        self.v.index_put_(idx, value)
        lengths += n if counts is None else counts

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [B, H, max_pages_per_seq * page_size, D]: each row's pages in table order."""
        B, M, P = self.batch_size, self.max_pages_per_seq, self.page_size
        table = self.block_table.long()
        k = self.k[table].permute(0, 2, 1, 3, 4).reshape(B, self.num_kv_heads, M * P, self.head_dim)
        v = self.v[table].permute(0, 2, 1, 3, 4).reshape(B, self.num_kv_heads, M * P, self.head_dim)
        return k, v

    def attend(self, query: torch.Tensor, step: Step = DECODE, scale: Optional[float] = None) -> torch.Tensor:
        self._check_attend(query, step.counts)
        lengths, q = self.lengths, query.shape[2]
        counts = torch.full_like(lengths, q) if step.counts is None else step.counts
        pos = (lengths - counts)[:, None] + torch.arange(q, device=query.device)[None, :]
        k, v = self.gathered()
        t = torch.arange(k.shape[2], device=query.device)
        visible = t[None, None, :] <= pos[:, :, None]
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        return F.scaled_dot_product_attention(query, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(self.lengths.max())
        k, v = (t[:, :, :n] for t in self.gathered())
        inside = (torch.arange(n, device=self.device)[None, :] < self.lengths[:, None])[:, None, :, None]
        return torch.where(inside, k, 0), torch.where(inside, v, 0)


class PagedFPCache(StaticCacheBase):
    """The paged fp cache: one PagedFPLayer per layer over one block table, every entry on the null page."""

    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = DEFAULT_PAGE_SIZE, max_pages_per_seq: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", windows=None):
        _check_num_layers(num_layers)
        for name, value in (("batch_size", batch_size), ("num_pages", num_pages), ("page_size", page_size),
                            ("max_pages_per_seq", max_pages_per_seq)):
            _check_positive(name, value)
        if windows is not None and any(w is not None for w in windows):
            raise ValueError("a paged cache has no sliding-window layers (the model has some): serve it without "
                             "--paged")
        table = torch.full((batch_size, max_pages_per_seq), num_pages, dtype=torch.int32, device=device)
        super().__init__([PagedFPLayer(block_table=table, num_pages=num_pages, page_size=page_size,
                                       batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                       dtype=dtype, device=device) for _ in range(num_layers)])
        self.block_table = table
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq

    @property
    def null_page(self) -> int:
        return self.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    def pages_final(self, num_tokens: int) -> int:
        """Pages no later append writes: the full ones."""
        pages_needed(num_tokens, self.page_size)
        return num_tokens // self.page_size

    def page_nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers) // self.num_pages

    def nbytes(self) -> int:
        return super().nbytes() + self.block_table.numel() * self.block_table.element_size()

    def reset(self) -> None:
        super().reset()

    def load_row(self, *args, **kwargs):
        raise TypeError("a paged cache copies a sequence with kivi_ops.cache.paged_io.copy_sequence (pages + row state), "
                        "not load_row")
