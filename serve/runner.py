"""The only part of `kivi serve` that touches the model or the cache: it executes one Plan at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kivi_ops.dispatch import cpu_compiled
from kivi_ops.cache.paged_io import copy_sequence, load_sequence, move_row, save_sequence
from kivi_ops.cache.row_view import leading_rows

from kivi_models.generate import compile_decode_step, decode_step, make_cache, make_paged_cache, prefill, prefill_chunked
from .plan import Output, Plan
from .prefix_cache import restore_prefix, save_tail


@dataclass(frozen=True)
class RowPages:
    """A static cache as the scheduler sees a paged one: one page of max_seq_len tokens per row."""

    num_pages: int
    page_size: int
    max_pages_per_seq: int = 1

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class Runner:

    # Seconds the engine may idle between calls (None: forever): TP's idle workers' wait times out.
    heartbeat_s: Optional[float] = None
    # Why this runner can no longer run (TP: a rank died or fell out of step); None while it can.
    failure: Optional[str] = None

    def __init__(self, model, *, method: str, kivi_config, slots: int, max_seq_len: int, paging=None,
                 compile: bool = False):
        self.model, self.device, self.paged = model, model.device, paging is not None
        if paging is None:
            self.cache = make_cache(model, method=method, batch_size=slots, max_seq_len=max_seq_len,
                                    kivi_config=kivi_config)
            self.staging = make_cache(model, method=method, batch_size=1, max_seq_len=max_seq_len,
                                      kivi_config=kivi_config)
        else:
            paged = dict(method=method, max_seq_len=max_seq_len, page_size=paging.page_size, kivi_config=kivi_config)
            self.cache = make_paged_cache(model, batch_size=slots, num_pages=paging.num_pages, **paged)
            # Prompts are prefilled in the staging cache's pages 0, 1, ..., then copied into their own pages.
            width = self.cache.max_pages_per_seq
            self.staging = make_paged_cache(model, batch_size=1, num_pages=width, **paged)
            self.staging_table = torch.arange(width, dtype=torch.int32, device=self.device)[None]
        self.layout = self.cache if self.paged else RowPages(num_pages=slots, page_size=max_seq_len)
        self.step_fn = compile_decode_step(self.device) if compile else decode_step
        self.saved: dict[int, object] = {}  # host key -> a swapped-out sequence's copy or a cached prefix's tail
        self.views = {slots: self.cache}
        self.table = torch.full((slots, self.layout.max_pages_per_seq), self.layout.num_pages, dtype=torch.int32)
        self.doing = "the round"  # what execute() is doing now: names a failure no request owns

    def execute(self, plan: Plan) -> Output:
        """Carry out one plan in order; a swap's or prefill's failure is its request's, others raise."""
        out = Output()
        for s in plan.swap_out:
            self.doing = "swapping preempted requests out"
            self._isolated(out, s.key, self.save, s.row, list(s.pages), s.key)
        for s in plan.swap_in:
            self.doing = "swapping a request back in"
            self._isolated(out, s.key, self.load, s.row, list(s.pages), s.key)
        for p in plan.prefills:
            self.doing = "a prefill"
            if p.chunk:
                logits = self._isolated(out, p.key, self.prefill_chunked, p.row, list(p.tokens), list(p.pages), p.chunk,
                                        p.start, p.shared, p.tail_key, list(p.boundaries), list(p.tail_keys))
            else:
                logits = self._isolated(out, p.key, self.prefill, p.row, list(p.tokens), list(p.pages))
            if logits is not None:
                out.prefill_logits[p.row] = logits
        self.doing = "dropping host copies"
        for key in plan.drops:
            self.drop(key)
        self.doing = "moving requests into the lowest rows"
        for src, dst in plan.moves:
            self.move(src, dst)
        self.doing = "writing the block table"
        for row, pages in plan.table:
            self.table[row].fill_(self.layout.num_pages)
            self.table[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        if plan.table:
            self.write_table(self.table)
        if plan.decode:
            self.doing = "the decode step"
            out.decode_logits = self.decode(list(plan.decode))
        if plan.stop_compiling:
            self.stop_compiling()
        return out

    def _isolated(self, out: Output, key: int, action, *args):
        try:
            return action(*args)
        except Exception as e:
            self.drop(key)  # a half-made copy is of no use
            out.failures[key] = e
            return None

    def prefill(self, slot: int, prompt_ids: list[int], pages: list[int]) -> torch.Tensor:
        """Prefill one prompt alone, as `kivi generate` does, into row `slot` and `pages`: its last logits [1, V]."""
        self._stage()
        input_ids = torch.tensor([prompt_ids], device=self.device)
        counts = torch.tensor([len(prompt_ids)], device=self.device)
        logits = prefill(self.model, self.staging, input_ids, counts)
        if self.paged:
            copy_sequence(self.cache, slot, pages, self.staging, 0, range(len(pages)))
        else:
            self.cache.load_row(slot, self.staging)
        return logits

    def _stage(self) -> None:
        self.staging.reset()
        if self.paged:
            self.staging.block_table.copy_(self.staging_table)

    def prefill_chunked(self, slot: int, prompt_ids: list[int], pages: list[int], chunk: int, start: int, shared: int,
                        tail_key: int, boundaries: list[int], keys: list[int]) -> torch.Tensor:
        """--prefix-caching: prefill in chunks from a cached prefix of `start` tokens, keeping a tail per boundary."""
        self._stage()
        staged = range(self.cache.max_pages_per_seq)
        tails = dict(zip(boundaries, keys))

        def at_boundary(b: int) -> None:
            if b in tails:
                self.saved[tails[b]] = save_tail(self.staging, 0, staged, b)

        try:
            if tail_key >= 0:
                restore_prefix(self.staging, 0, staged, self.cache, pages[:shared], self.saved[tail_key])
            logits = prefill_chunked(self.model, self.staging, prompt_ids, chunk, start=start, on_boundary=at_boundary)
        except BaseException:
            for key in keys:
                self.saved.pop(key, None)
            raise
        copy_sequence(self.cache, slot, pages[shared:], self.staging, 0, staged[shared:len(pages)])
        return logits

    def save(self, slot: int, pages: list[int], key: int) -> None:
        self.saved[key] = save_sequence(self.cache, slot, pages)

    def load(self, slot: int, pages: list[int], key: int) -> None:
        load_sequence(self.cache, slot, pages, self.saved.pop(key))

    def drop(self, key: int) -> None:
        self.saved.pop(key, None)

    def write_table(self, table: torch.Tensor) -> None:
        if self.paged:
            self.cache.block_table.copy_(table)

    def move(self, src: int, dst: int) -> None:
        move_row(self.cache, src, dst)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode step over the first len(tokens) rows (tokens[row] -1: no request, nothing stored)."""
        cache = self.views.get(len(tokens))
        if cache is None:
            cache = self.views[len(tokens)] = leading_rows(self.cache, len(tokens))
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        counts = (ids >= 0).long()
        positions = cache.lengths().clone()
        return self.step_fn(self.model, cache, ids.clamp(min=0), positions, counts)

    def stop_compiling(self) -> None:
        """From now on this thread compiles no new kernel shape (a compile would stall every stream)."""
        cpu_compiled.stop_compiling_on_this_thread()

    def flush(self) -> None:
        """The end of an engine round (tensor parallelism: a heartbeat when due)."""

    def close(self) -> None:
        """The engine stops (tensor parallelism: stop the other ranks)."""

    def cache_bytes_by_rank(self) -> list[int]:
        return [self.cache.nbytes()]
