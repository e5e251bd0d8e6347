"""Which full-precision window slot each running request owns, for every KIVI layer of this worker.

vLLM's blocks hold the quantized pages; a request's fp window (its last R tokens) lives in slot
`slot(req_id)` of every layer's window pool [max_num_seqs, H, R, D]. The model runner tells us the
requests: `on_update` runs after GPUModelRunner._update_states (wrapped in register()), freeing
the slots of finished requests; `rows` maps the batch the runner is about to run (its input
batch's order, which is the order of the attention metadata) to slots. A request preempted by
recompute keeps its slot and starts again at token 0, which rewrites its window."""

from __future__ import annotations

import torch


class WindowSlots:
    def __init__(self):
        self.capacity = 0
        self.slot_of: dict[str, int] = {}
        self.runner = None
        # Tests: a list to which every step appends [(prompt token ids, tokens before, tokens now)]
        # per request, the schedule the library's replay follows (tests/library_reference.py).
        self.trace = None

    def reserve(self, capacity: int) -> None:
        self.capacity = capacity

    def on_update(self, runner, scheduler_output) -> None:
        if runner is not self.runner:  # a new engine in this process: the old one's requests are gone
            self.slot_of.clear()
            self.runner = runner
        # A preempted request waits in vLLM's queue (not counted by --max-num-seqs) and restarts at
        # token 0, which rewrites a window: its slot is free until it runs again.
        for req_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self.slot_of.pop(req_id, None)

    def rows(self, num_reqs: int) -> tuple[torch.Tensor, list[int]]:
        """Slots of the first num_reqs requests of the runner's input batch (new ones get a free slot),
        and the batch indices of those new ones."""
        if self.runner is None:
            raise RuntimeError("the KIVI backend needs the model runner hook (kivi_vllm.register) to be installed")
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        used = set(self.slot_of.values())
        free = (s for s in range(self.capacity) if s not in used)
        fresh = []
        for b, r in enumerate(req_ids):
            if r not in self.slot_of:
                fresh.append(b)
                slot = next(free, None)
                if slot is None:
                    raise RuntimeError(f"no free KIVI window slot for request {r} ({self.capacity} slots, "
                                       "--max-num-seqs)")
                self.slot_of[r] = slot
        return torch.tensor([self.slot_of[r] for r in req_ids], dtype=torch.long), fresh

    def request(self, b: int):
        """The model runner's state of batch row b's request (its prompt_token_ids, output_token_ids)."""
        return self.runner.requests[self.runner.input_batch.req_ids[b]]

    def record(self, num_reqs: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> None:
        if self.trace is None:
            return
        qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
        reqs = self.runner.requests
        self.trace.append([(tuple(reqs[r].prompt_token_ids), sl[b] - (qsl[b + 1] - qsl[b]), qsl[b + 1] - qsl[b])
                           for b, r in enumerate(self.runner.input_batch.req_ids[:num_reqs])])


SLOTS = WindowSlots()
