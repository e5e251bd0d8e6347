"""Tensor-parallel `kivi serve` under torchrun: rank 0 decides, every rank computes its shard.

`torchrun --nproc-per-node N kivi serve ...`: every rank loads the model tensor-parallel
(parallel.py: whole KV heads per rank) and builds the same Runner (runner.py) over a cache of
its own heads. Rank 0 alone runs the HTTP server, tokenizes, schedules (block manager included) and
samples; its runner is a LeaderRunner, which sends every cache action to the other ranks before
doing it itself. The other ranks run `run_worker`: receive a plan, replay it on their runner, repeat.
So every rank runs the same prefills and the same compiled decode step on the same rows, pages and
counts, in the same order, and the model's own all-reduces line up. The logits every rank gets are
whole (transformers' TP plan gathers the LM head's output); only rank 0 samples from them, and its
tokens reach the others in the next decode step's plan.

A plan is two int64 tensors broadcast over a gloo group (CPU tensors, also when the model's
collectives run on nccl; no pickling):
- the header, fixed size HEADER + rows: [MAGIC, kind, sequence number, payload length, the rows n
  the decode step runs over (0: none; paged: a decode bucket), then each of those n rows' token
  (-1: the row takes no token), then unused entries];
- the payload (broadcast only when its length is not 0): the records of the cache actions that come
  before the decode step, in order, each [op code, its fields...], a field being an int or a list
  of ints written as [length, values...] (OPS gives each op's fields).
A pure decode step is therefore one broadcast of rows + 5 integers.

Failures: every collective has the group's timeout (--tp-timeout), so nothing waits forever. When a
plan cannot be sent, or a prefill or decode fails on rank 0 (a rank died: gloo reports the closed
connection; or a collective timed out), the other ranks may be out of step: the leader records a
`failure` and the engine ends every request with a 503 and refuses new ones. Idle, the leader sends
an empty plan every timeout / 4 s (the workers' wait for the next plan would time out otherwise),
which also notices a dead rank without traffic. A worker whose plan or replay fails exits non-zero.
A stop on rank 0 (the engine closing) sends STOP: every worker returns and exits 0.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .runner import Runner

MAGIC = 0x4B495649  # "KIVI": a header that does not start with it is not a plan (out of step)
PLAN, STOP = 1, 2
HEADER = 5  # MAGIC, kind, sequence number, payload length, rows decoded (0: no decode step); then their tokens


@dataclass(frozen=True)
class Op:
    """A cache action workers replay: its code in the payload, the Runner method (or Worker method)
    it calls, and its fields in the method's argument order ("i": an int, "l": a list of ints)."""

    code: int
    name: str
    fields: str


# A new cache action adds its Runner method here. Which pages a sequence holds, shared or not,
# needs nothing new: page ids reach the workers in prefill/save/load records and in block table
# rows, so the block manager's decisions, made once on rank 0, apply everywhere; each rank keeps
# its own heads' host copies (swaps, cached prefixes' tails) under the keys rank 0 draws.
OPS = (
    Op(1, "prefill", "ill"),  # slot, prompt ids, pages
    Op(2, "save", "ili"),  # slot, pages, key
    Op(3, "load", "ili"),  # slot, pages, key
    Op(4, "drop", "i"),  # key
    Op(5, "table_row", "il"),  # row, its page ids (the rest of the row: unused)
    # slot, prompt ids, pages, chunk, start, shared pages, tail key, boundaries to keep, their keys
    Op(6, "prefill_chunked", "illiiiill"),
    Op(7, "move", "ii"),  # src row, dst row
    Op(8, "stop_compiling", ""),  # warm-up done: compile nothing more (every rank, as rank 0)
)
BY_CODE = {op.code: op for op in OPS}
BY_NAME = {op.name: op for op in OPS}


class GroupFailure(RuntimeError):
    """The ranks can no longer run together (a rank died, a collective failed or timed out)."""


class OutOfStep(RuntimeError):
    """A worker received something that is not the next plan (a bug, or mismatched launches)."""


# ---------------------------------------------------------------- the plan's encoding


def encode_record(name: str, *args) -> list[int]:
    op = BY_NAME[name]
    if len(args) != len(op.fields):
        raise TypeError(f"{name} takes {len(op.fields)} fields ({op.fields}), got {len(args)}")
    out = [op.code]
    for kind, value in zip(op.fields, args):
        if kind == "i":
            out.append(int(value))
        else:
            values = [int(v) for v in value]
            out += [len(values), *values]
    return out


def decode_records(payload: list[int]) -> list[tuple[str, tuple]]:
    records, i = [], 0
    while i < len(payload):
        op = BY_CODE.get(payload[i])
        if op is None:
            raise OutOfStep(f"unknown op code {payload[i]} at {i} in a plan's payload")
        i += 1
        args = []
        for kind in op.fields:
            n = 1 if kind == "i" else 1 + (payload[i] if i < len(payload) else 0)
            if i + n > len(payload):
                raise OutOfStep(f"a {op.name} record runs past the end of the payload")
            args.append(payload[i] if kind == "i" else payload[i + 1:i + n])
            i += n
        records.append((op.name, tuple(args)))
    return records


@dataclass(frozen=True)
class StepBroadcast:
    kind: int  # PLAN or STOP
    seq: int  # plans are numbered from 0: a worker checks it gets the next one
    records: tuple = ()  # the payload's (op name, fields), in order
    tokens: Optional[tuple] = None  # the decode step's token per row (-1: none); None: no decode step


def encode_plan(plan: StepBroadcast, rows: int,
                records: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(header int64 [HEADER + rows], payload int64 [n]). records: the payload already encoded
    (the leader queues records as it goes), else plan.records is encoded."""
    if records is None:
        records = [x for name, args in plan.records for x in encode_record(name, *args)]
    header = torch.full((HEADER + rows,), -1, dtype=torch.long)
    decoded = 0 if plan.tokens is None else len(plan.tokens)
    header[:HEADER] = torch.tensor([MAGIC, plan.kind, plan.seq, len(records), decoded])
    if plan.tokens is not None:
        if not 1 <= decoded <= rows:
            raise ValueError(f"a decode step needs one token per row it runs over (1 to {rows}), got {decoded}")
        header[HEADER:HEADER + decoded] = torch.tensor(plan.tokens, dtype=torch.long)
    return header, torch.tensor(records, dtype=torch.long)


def decode_plan(header: torch.Tensor, payload: torch.Tensor) -> StepBroadcast:
    head = header.tolist()
    if head[0] != MAGIC or head[1] not in (PLAN, STOP):
        raise OutOfStep(f"not a plan header: {head[:HEADER]}")
    if head[3] != payload.numel():
        raise OutOfStep(f"the header announces {head[3]} payload ints, got {payload.numel()}")
    if not 0 <= head[4] <= len(head) - HEADER:
        raise OutOfStep(f"the header announces a decode step over {head[4]} rows, of {len(head) - HEADER}")
    return StepBroadcast(kind=head[1], seq=head[2], records=tuple(decode_records(payload.tolist())),
                tokens=tuple(head[HEADER:HEADER + head[4]]) if head[4] else None)


# ---------------------------------------------------------------- transport


class DistChannel:
    """Rank 0 -> the others over `group` (gloo): a fixed-size header, then the payload it announces."""

    def __init__(self, group):
        self.group = group

    def send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(header, 0, group=self.group)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)

    def recv(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next plan's (header, payload), for a cache of `rows` rows."""
        import torch.distributed as dist

        header = torch.empty(HEADER + rows, dtype=torch.long)
        dist.broadcast(header, 0, group=self.group)
        payload = torch.empty(int(header[3]), dtype=torch.long)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)
        return header, payload

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's `row` (int64 [n]), stacked [world, n], on every rank."""
        import torch.distributed as dist

        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        return torch.stack(rows)


def signature(runner: Runner) -> torch.Tensor:
    """[rows, pages, pages per row, cache bytes] of this rank's cache (int64)."""
    cache = runner.cache
    shape = [cache.batch_size, getattr(cache, "num_pages", 0), getattr(cache, "max_pages_per_seq", 0)]
    return torch.tensor([*shape, cache.nbytes()], dtype=torch.long)


def handshake(channel, runner: Runner) -> list[int]:
    """Every rank checks that all built the same cache shape (rows, pages, table width: the plans
    mean the same rows and pages everywhere); returns each rank's cache bytes."""
    mine = signature(runner)
    shape = mine[:3].tolist()
    rows = channel.gather(mine).tolist()
    if any(r[:3] != shape for r in rows):
        raise ValueError(f"the ranks built different caches ([rows, pages, pages per row] by rank: "
                         f"{[r[:3] for r in rows]}); launch every rank with the same flags")
    return [r[3] for r in rows]


def init_groups(device: str, timeout_s: float):
    """The default process group (the model's collectives: gloo on CPU, nccl on CUDA) and a gloo
    group for the plans, both with a `timeout_s` timeout on every collective. Returns the plan group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=local)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


# ---------------------------------------------------------------- rank 0


class LeaderRunner(Runner):
    """Rank 0's runner: each cache action is queued as a record for the workers and done here; a
    forward (prefill, decode step) first sends the queued records with it, since every rank must
    enter the model's collectives together."""

    def __init__(self, model, *, channel, timeout_s: float, **kwargs):
        super().__init__(model, **kwargs)
        self.channel, self.rows = channel, kwargs["slots"]
        self.heartbeat_s = max(timeout_s / 4, 0.1)
        self.seq, self.pending, self.lock = 0, [], threading.Lock()  # drop() may come from another thread
        self.last_sent = time.monotonic()
        self.sent_table: Optional[torch.Tensor] = None  # the block table the workers hold
        self.by_rank = handshake(channel, self)

    def _queue(self, name: str, *args) -> None:
        record = encode_record(name, *args)
        with self.lock:
            self.pending += record

    def _send(self, tokens: Optional[list[int]] = None, kind: int = PLAN) -> None:
        if self.failure is not None:
            raise GroupFailure(self.failure)
        with self.lock:
            records, self.pending = self.pending, []
        header, payload = encode_plan(StepBroadcast(kind, self.seq, tokens=None if tokens is None else tuple(tokens)),
                                      self.rows, records)
        try:
            self.channel.send(header, payload)
        except Exception as e:
            self.failure = f"rank 0 could not send a step to the other ranks ({type(e).__name__}: {e})"
            raise GroupFailure(self.failure) from e
        self.seq += 1
        self.last_sent = time.monotonic()

    def _forward(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # mid-forward, the ranks' collectives may no longer line up
            self.failure = f"a step failed on rank 0, so the ranks may be out of step ({type(e).__name__}: {e})"
            raise

    def prefill(self, slot: int, prompt_ids: list[int], pages: list[int]) -> torch.Tensor:
        self._queue("prefill", slot, prompt_ids, pages)
        self._send()
        return self._forward(super().prefill, slot, prompt_ids, pages)

    def prefill_chunked(self, *args) -> torch.Tensor:
        self._queue("prefill_chunked", *args)
        self._send()
        return self._forward(super().prefill_chunked, *args)

    def save(self, slot: int, pages: list[int], key: int) -> None:
        self._queue("save", slot, pages, key)
        super().save(slot, pages, key)

    def load(self, slot: int, pages: list[int], key: int) -> None:
        self._queue("load", slot, pages, key)
        super().load(slot, pages, key)

    def drop(self, key: int) -> None:
        self._queue("drop", key)
        super().drop(key)

    def move(self, src: int, dst: int) -> None:
        self._queue("move", src, dst)
        super().move(src, dst)

    def stop_compiling(self) -> None:
        self._queue("stop_compiling")
        super().stop_compiling()

    def write_table(self, table: torch.Tensor) -> None:
        if not self.paged:
            return  # a static cache has no block table (Runner.write_table)
        sent = self.sent_table
        for row in range(table.shape[0]):  # only the rows that changed, without their unused tail
            if sent is None or not torch.equal(sent[row], table[row]):
                used = (table[row] != self.cache.num_pages).nonzero()
                self._queue("table_row", row, table[row, :int(used.max()) + 1 if used.numel() else 0].tolist())
        self.sent_table = table.clone()
        super().write_table(table)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        self._send(tokens)
        return self._forward(super().decode, tokens)

    def flush(self) -> None:
        """Send what is queued, or, after heartbeat_s without a plan, an empty one."""
        if self.pending or time.monotonic() - self.last_sent >= self.heartbeat_s:
            self._send()

    def close(self) -> None:
        if self.failure is None:
            try:
                self._send(kind=STOP)
            except GroupFailure:
                pass

    def cache_bytes_by_rank(self) -> list[int]:
        return self.by_rank


# ---------------------------------------------------------------- the other ranks


class Worker:
    """Replays rank 0's plans on this rank's runner, in order."""

    def __init__(self, runner: Runner):
        self.runner, self.seq = runner, 0
        self.table = runner.cache.block_table.cpu().clone() if runner.paged else None
        self.table_changed = False

    def apply(self, plan: StepBroadcast) -> bool:
        """Carry out one plan; False once told to stop."""
        if plan.seq != self.seq:
            raise OutOfStep(f"expected plan {self.seq}, got plan {plan.seq}")
        self.seq += 1
        if plan.kind == STOP:
            return False
        with torch.inference_mode():
            for name, args in plan.records:
                getattr(self if name == "table_row" else self.runner, name)(*args)
            if self.table_changed:
                self.runner.write_table(self.table)
                self.table_changed = False
            if plan.tokens is not None:
                self.runner.decode(list(plan.tokens))
        return True

    def table_row(self, row: int, pages: list[int]) -> None:
        self.table[row].fill_(self.runner.cache.num_pages)
        self.table[row, :len(pages)] = torch.tensor(pages, dtype=self.table.dtype)
        self.table_changed = True


def run_worker(runner: Runner, channel) -> int:
    """A rank other than 0: replay plans until rank 0 says stop (0) or can no longer be heard (1).
    SIGINT and SIGTERM are left to rank 0 (torchrun signals every rank; rank 0 drains its requests,
    which needs the workers, then stops them)."""
    handshake(channel, runner)
    worker = Worker(runner)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            header, payload = channel.recv(runner.cache.batch_size)
        except Exception as e:  # rank 0 died, or sent nothing within the timeout
            print(f"kivi serve (rank {os.environ.get('RANK')}): lost rank 0 ({type(e).__name__}: {e}); stopping",
                  file=sys.stderr, flush=True)
            return 1
        if not worker.apply(decode_plan(header, payload)):
            return 0
