"""Tensor-parallel `kivi serve` under torchrun: rank 0 schedules and samples and broadcasts each plan;
every rank executes it on its own heads' cache (the format and the failures: docs/parallel.md)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from dataclasses import astuple, dataclass, is_dataclass

import torch

from .plan import Output, Plan, Prefill, Swap
from .runner import Runner

MAGIC = 0x4B495649  # a header that does not start with it is not a plan (out of step)
PLAN, STOP = 1, 2
HEADER = 4

# The Plan's fields in order: an item's fields ("i": int, "l": list of ints) and its type (None: a tuple).
FIELDS = (("swap_out", "iil", Swap), ("swap_in", "iil", Swap), ("prefills", "iilliiiill", Prefill),
          ("drops", "i", None), ("moves", "ii", None), ("table", "il", None))


class GroupFailure(RuntimeError):
    """The ranks can no longer run together (a rank died, a collective failed or timed out)."""


class OutOfStep(RuntimeError):
    """A worker received something that is not the next plan (a bug, or mismatched launches)."""


# ---------------------------------------------------------------- the plan's encoding


@dataclass(frozen=True)
class Sent:

    kind: int
    seq: int
    plan: Plan = Plan()


def _values(item, kinds: str) -> tuple:
    return (item,) if kinds == "i" else astuple(item) if is_dataclass(item) else tuple(item)


def encode_plan(sent: Sent) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for name, kinds, _ in FIELDS:
        items = getattr(sent.plan, name)
        out.append(len(items))
        for item in items:
            for kind, value in zip(kinds, _values(item, kinds)):
                out += [int(value)] if kind == "i" else [len(value), *map(int, value)]
    out += [len(sent.plan.decode), *sent.plan.decode, int(sent.plan.stop_compiling)]
    header = torch.tensor([MAGIC, sent.kind, sent.seq, len(out)], dtype=torch.long)
    return header, torch.tensor(out, dtype=torch.long)


def decode_plan(header: torch.Tensor, payload: torch.Tensor) -> Sent:
    head, ints = header.tolist(), payload.tolist()
    if len(head) != HEADER or head[0] != MAGIC or head[1] not in (PLAN, STOP):
        raise OutOfStep(f"not a plan header: {head}")
    if head[3] != len(ints):
        raise OutOfStep(f"the header announces {head[3]} payload ints, got {len(ints)}")
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        if n < 0 or at + n > len(ints):
            raise OutOfStep(f"a plan's field runs past the end of the payload (at {at} of {len(ints)})")
        at += n
        return ints[at - n:at]

    fields = {}
    for name, kinds, make in FIELDS:
        items = []
        for _ in range(take(1)[0]):
            values = tuple(take(1)[0] if kind == "i" else tuple(take(take(1)[0])) for kind in kinds)
            items.append(values[0] if kinds == "i" else make(*values) if make else values)
        fields[name] = tuple(items)
    decode = tuple(take(take(1)[0]))
    stop_compiling = bool(take(1)[0])
    if at != len(ints):
        raise OutOfStep(f"{len(ints) - at} payload ints past the plan's end")
    return Sent(head[1], head[2], Plan(**fields, decode=decode, stop_compiling=stop_compiling))


class DistChannel:

    def __init__(self, group):
        self.group = group

    def send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(header, 0, group=self.group)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)

    def recv(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        header = torch.empty(HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self.group)
        payload = torch.empty(int(header[3]), dtype=torch.long)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.group)
        return header, payload

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        return torch.stack(rows)


def signature(runner: Runner) -> torch.Tensor:
    cache = runner.cache
    shape = [cache.batch_size, getattr(cache, "num_pages", 0), getattr(cache, "max_pages_per_seq", 0)]
    return torch.tensor([*shape, cache.nbytes()], dtype=torch.long)


def handshake(channel, runner: Runner) -> list[int]:
    mine = signature(runner)
    shape = mine[:3].tolist()
    rows = channel.gather(mine).tolist()
    if any(r[:3] != shape for r in rows):
        raise ValueError(f"the ranks built different caches ([rows, pages, pages per row] by rank: "
                         f"{[r[:3] for r in rows]}); launch every rank with the same flags")
    return [r[3] for r in rows]


def init_groups(device: str, timeout_s: float):
    """The model's default group and a gloo group for the plans, each with a `timeout_s` timeout."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=local)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


class LeaderRunner(Runner):
    """Rank 0's runner: broadcast each plan, then execute it (every rank enters the collectives together)."""

    def __init__(self, model, *, channel, timeout_s: float, **kwargs):
        super().__init__(model, **kwargs)
        self.channel = channel
        self.heartbeat_s = max(timeout_s / 4, 0.1)
        self.seq, self.closed = 0, False
        self.last_sent = time.monotonic()
        self.by_rank = handshake(channel, self)

    def _send(self, sent: Sent) -> None:
        if self.failure is not None:
            raise GroupFailure(self.failure)
        try:
            self.channel.send(*encode_plan(sent))
        except Exception as e:
            self.failure = f"rank 0 could not send a step to the other ranks ({type(e).__name__}: {e})"
            raise GroupFailure(self.failure) from e
        self.seq += 1
        self.last_sent = time.monotonic()

    def execute(self, plan: Plan) -> Output:
        if self.closed:  # the workers stopped: host copies are forgotten here alone
            return super().execute(Plan(drops=plan.drops))
        self._send(Sent(PLAN, self.seq, plan))
        try:
            out = super().execute(plan)
        except Exception as e:  # mid-forward, the ranks' collectives may no longer line up
            self.failure = f"a step failed on rank 0, so the ranks may be out of step ({type(e).__name__}: {e})"
            raise
        failed = [out.failures[p.key] for p in plan.prefills if p.key in out.failures]
        if failed:  # a forward: the workers' may not have failed alike
            e = failed[0]
            self.failure = f"a step failed on rank 0, so the ranks may be out of step ({type(e).__name__}: {e})"
            raise e
        return out

    def flush(self) -> None:
        """Idle for heartbeat_s: an empty plan, so the workers' wait does not time out."""
        if time.monotonic() - self.last_sent >= self.heartbeat_s:
            self._send(Sent(PLAN, self.seq))

    def close(self) -> None:
        if self.failure is None and not self.closed:
            try:
                self._send(Sent(STOP, self.seq))
            except GroupFailure:
                pass
        self.closed = True

    def cache_bytes_by_rank(self) -> list[int]:
        return self.by_rank


class Worker:

    def __init__(self, runner: Runner):
        self.runner, self.seq = runner, 0

    def apply(self, sent: Sent) -> bool:
        if sent.seq != self.seq:
            raise OutOfStep(f"expected plan {self.seq}, got plan {sent.seq}")
        self.seq += 1
        if sent.kind == STOP:
            return False
        with torch.inference_mode():
            out = self.runner.execute(sent.plan)
        if out.failures:
            raise next(iter(out.failures.values()))
        return True


def run_worker(runner: Runner, channel) -> int:
    """A rank other than 0: execute plans until rank 0 says stop (0) or goes silent (1).
    Signals are left to rank 0, whose drain needs the workers."""
    handshake(channel, runner)
    worker = Worker(runner)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            header, payload = channel.recv()
        except Exception as e:
            print(f"kivi serve (rank {os.environ.get('RANK')}): lost rank 0 ({type(e).__name__}: {e}); stopping",
                  file=sys.stderr, flush=True)
            return 1
        if not worker.apply(decode_plan(header, payload)):
            return 0
