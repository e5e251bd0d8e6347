"""The serve engine's hands: the only thing of `kivi serve` that touches the model or the cache. It
carries out one plan (plan.py) at a time, `execute`, through the primitive actions below; tensor
parallelism sends each plan to the other ranks first, whose plain Runner executes it too (tp.py).
"""

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
    """A static cache as the scheduler sees a paged one: one page of max_seq_len tokens per row,
    `rows` pages in all. A request holds one page while it runs, whatever its length, so a static
    engine admits while a row is free and never preempts; which page id it holds does not matter,
    its row is where its tokens are."""

    num_pages: int
    page_size: int
    max_pages_per_seq: int = 1

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class Runner:
    """The cache of `slots` rows (static rows of max_seq_len tokens, or with `paging` a paged cache),
    a batch-1 staging cache for prefills, the decode step (compiled with `compile`), and host
    copies of swapped-out sequences (keyed by an int the engine chooses)."""

    # Seconds the engine may stay idle between two calls (None: forever). Tensor parallelism's
    # leader sets it: its idle workers wait in a collective that times out (tp.py).
    heartbeat_s: Optional[float] = None
    # Why this runner can no longer run (tensor parallelism: a rank died or fell out of step); the
    # engine then ends every request with a 503. None while it can.
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
            # The staging cache holds one sequence in pages 0, 1, ...: a prompt is prefilled there,
            # then its pages and row state are copied into the pages the block manager gave it.
            width = self.cache.max_pages_per_seq
            self.staging = make_paged_cache(model, batch_size=1, num_pages=width, **paged)
            self.staging_table = torch.arange(width, dtype=torch.int32, device=self.device)[None]
        # The pages the engine schedules: the paged cache's own, or one per static row.
        self.layout = self.cache if self.paged else RowPages(num_pages=slots, page_size=max_seq_len)
        self.step_fn = compile_decode_step(self.device) if compile else decode_step
        self.saved: dict[int, object] = {}  # key -> a swapped-out sequence's host copy or a cached prefix's tail (paged)
        self.views = {slots: self.cache}  # rows -> the paged cache's first rows (decode buckets), made once each
        self.table = torch.full((slots, self.layout.max_pages_per_seq), self.layout.num_pages, dtype=torch.int32)
        self.doing = "the round"  # what execute() is doing now: a failure no request owns is named by it

    def execute(self, plan: Plan) -> Output:
        """Carry out one plan in its order. A swap's or a prefill's failure is that request's
        (Output.failures, its host copies dropped); any other raises."""
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
            self.drop(key)  # a swap's copy, half made or half read, is of no use
            out.failures[key] = e
            return None

    def prefill(self, slot: int, prompt_ids: list[int], pages: list[int]) -> torch.Tensor:
        """Prefill one prompt alone (exact attention, then quantization, as `kivi generate` does) and
        move it into row `slot` (paged: into `pages`, the pages its prompt needs; static: the row).
        Returns the logits [1, V] of its last token."""
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
        """--prefix-caching: prefill one prompt in chunks (generate.prefill_chunked) and move it into
        row `slot` and `pages` (the pages its prompt needs, in order). start > 0: it starts from a
        cached prefix of `start` tokens, whose pages are pages[:shared] (in the pool already,
        shared) and whose tail is the host copy kept under tail_key (-1: none). At each boundary
        in `boundaries` the tail is kept under the matching key of `keys` (every one is dropped
        again if the prefill fails). Returns the logits [1, V] of its last token."""
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
        """Swap out: host copies of row `slot`'s pages (in this order) and row state, kept under key."""
        self.saved[key] = save_sequence(self.cache, slot, pages)

    def load(self, slot: int, pages: list[int], key: int) -> None:
        """Swap in: the sequence saved under key into row `slot` and `pages` (as many as were saved)."""
        load_sequence(self.cache, slot, pages, self.saved.pop(key))

    def drop(self, key: int) -> None:
        """A swapped-out sequence ended (cancelled, timed out, aborted): forget its host copy."""
        self.saved.pop(key, None)

    def write_table(self, table: torch.Tensor) -> None:
        """The block table (host int32 [rows, pages per row]) into the device one, in one copy (a
        static cache has none: its rows are its pages)."""
        if self.paged:
            self.cache.block_table.copy_(table)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s sequence into the free row `dst` (paged: its row state; its pages stay, the
        engine writes its block-table row): requests are kept in the lowest rows."""
        move_row(self.cache, src, dst)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode step over the first len(tokens) rows (every row of a static cache; paged: a
        decode bucket, leading_rows): tokens[row] is the row's last token, or -1 for a row with no
        request (count 0: nothing is stored). Returns the logits [len(tokens), V]."""
        cache = self.views.get(len(tokens))
        if cache is None:
            cache = self.views[len(tokens)] = leading_rows(self.cache, len(tokens))
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        counts = (ids >= 0).long()
        positions = cache.lengths().clone()
        return self.step_fn(self.model, cache, ids.clamp(min=0), positions, counts)

    def stop_compiling(self) -> None:
        """Warm-up is done: from now on this thread compiles no new per-op CPU kernel shape (a shape
        met later runs the reference ops: a compile would stall every running stream for seconds)."""
        cpu_compiled.stop_compiling_on_this_thread()

    def flush(self) -> None:
        """The end of an engine round (tensor parallelism: a heartbeat when due)."""

    def close(self) -> None:
        """The engine stops (tensor parallelism: stop the other ranks)."""

    def cache_bytes_by_rank(self) -> list[int]:
        """Bytes of the cache each rank holds: [this one] outside tensor parallelism."""
        return [self.cache.nbytes()]
