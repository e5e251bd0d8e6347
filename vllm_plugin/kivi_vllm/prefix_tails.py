"""Prefix caching over KIVI blocks: what a shared block lacks is the full-precision window.

vLLM shares full blocks by the hash of the tokens before them. A KIVI block at a boundary b holds
everything final there (keys quantized R at a time, values as they leave the last R tokens), but the
last tokens' fp keys and values live in the writer's window, which moves on. So the backend cuts
prompts at the multiples of `chunk` (kivi_ops.cache.varlen: the cache at a boundary then depends on the
tokens before it alone) and keeps a host copy of every layer's window there, keyed by those tokens.
The scheduler hook (register) cuts vLLM's hit back to the longest boundary with a copy; a request
that starts there gets the copy in its window slot. What the request later flushes into a shared
block is what the writer flushed: the same fp tokens, quantized by the same ops (key groups never
straddle a boundary, since chunk is a multiple of the block and the block of group_size).

Chunks end at boundaries or at a prefill's end, so a block past a writer's last prompt boundary
was computed by a chunk that ended elsewhere (its prompt's end, or decode steps): its bytes differ
from what a request chunked at the boundaries would hold, although vLLM hashes it the same. The
backend marks each block it writes: `clean[block id]` is the key of the boundary it was computed
under, only for blocks below their writer's last prompt boundary; a hit is cut back to the longest
boundary whose blocks (the ones vLLM would hand out) are all clean under the reader's own keys.

Least recently used copies go first past `limit_bytes`; eviction runs only between steps, so a copy
the scheduler counted on is still there when the step restores it."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch


def boundary_keys(tokens: Sequence[int], chunk: int, upto: int) -> list[bytes]:
    """Keys of the boundaries chunk, 2 chunk, ... <= upto: a SHA-256 chain over the chunks, so a key
    names the whole prefix before its boundary."""
    keys, key = [], b""
    ids = np.asarray(tokens[:upto], dtype=np.int64)
    for end in range(chunk, upto + 1, chunk):
        key = hashlib.sha256(key + ids[end - chunk:end].tobytes()).digest()
        keys.append(key)
    return keys


class PrefixTails:
    def __init__(self):
        self.chunk = 0  # 0: prefix caching off in this process
        self.limit_bytes = 0
        self.entries: OrderedDict[bytes, dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.bytes = 0
        self.clean: dict[int, bytes] = {}  # block id -> the boundary key it was computed under (module doc)
        self.hits = 0  # requests that started from a copy (tests, logs)

    def configure(self, chunk: int, limit_bytes: int) -> None:
        self.chunk, self.limit_bytes = chunk, limit_bytes
        self.entries.clear()
        self.clean.clear()
        self.bytes = 0

    def mark(self, block_ids: Sequence[int], keys: Sequence[bytes], start: int, frontier: int, written: tuple,
             block: int) -> None:
        """After a step: the request's prefill went from prompt boundary `start` to `frontier`, so its
        blocks in between are clean under keys; the blocks of the tokens it wrote past the frontier
        (positions written = (begin, end)) are not."""
        per_chunk = self.chunk // block
        for j in range(start // block, frontier // block):
            self.clean[block_ids[j]] = keys[j // per_chunk]
        begin, end = max(written[0], frontier), written[1]
        for j in range(begin // block, min(-(-end // block), len(block_ids))):
            self.clean.pop(block_ids[j], None)

    def save(self, key: bytes, layer: str, k_window: torch.Tensor, v_window: torch.Tensor) -> None:
        entry = self.entries.setdefault(key, {})
        if layer not in entry:
            entry[layer] = (k_window.clone(), v_window.clone())
            self.bytes += 2 * k_window.nbytes
        self.entries.move_to_end(key)

    def load(self, key: bytes, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.entries.get(key, {})
        if layer not in entry:
            raise RuntimeError(f"KIVI prefix cache: no window copy of layer {layer} for a request the scheduler "
                               "started from a cached prefix")
        return entry[layer]

    def longest_hit(self, tokens: Sequence[int], hit: int, block_ids: Sequence[int], block: int) -> int:
        """The longest boundary <= hit tokens with a stored copy whose blocks (block_ids, the ones the
        hit would share) are all clean under these tokens' keys (0 if none)."""
        if not self.chunk:
            return 0
        keys, per_chunk = boundary_keys(tokens, self.chunk, hit), self.chunk // block
        clean_chunks = 0  # leading N-token chunks whose blocks are all clean
        while clean_chunks < len(keys) and all(
                self.clean.get(block_ids[j]) == keys[clean_chunks]
                for j in range(clean_chunks * per_chunk, (clean_chunks + 1) * per_chunk)):
            clean_chunks += 1
        for i in range(clean_chunks - 1, -1, -1):
            if keys[i] in self.entries:
                self.entries.move_to_end(keys[i])
                return (i + 1) * self.chunk
        return 0

    def evict(self, keep: set[bytes]) -> None:
        """Drop least recently used copies until under the limit; never those in keep."""
        for key in list(self.entries):
            if self.bytes <= self.limit_bytes:
                return
            if key not in keep:
                self.bytes -= sum(2 * k.nbytes for k, _ in self.entries.pop(key).values())


TAILS = PrefixTails()
