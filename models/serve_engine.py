"""Continuous batching over the static cache: the engine behind `kivi serve`.

Each row of the cache is a slot. One engine thread owns the model and the cache and loops:

1. admit: waiting requests (FIFO) take free rows; each prompt is prefilled alone in a batch-1
   staging cache (exactly `kivi generate`'s prefill: exact attention, then quantization) and that
   row's state is copied into the request's row (`load_row`; the other rows are untouched), so an
   admission costs the prompt alone, not a forward over every row;
2. step: one decode step for every row, counts 1 for rows with a request and 0 for free rows
   (nothing is stored for those), compiled once with static shapes, so requests coming and going
   never recompile it;
3. each request samples its own token (its own temperature, top-p and seeded generator), checks
   EOS, stop strings and max_tokens, and a finished, stopped or cancelled request frees its row
   at once.

Per-row lengths and statistics keep rows independent: a greedy completion equals `kivi generate`
of the same prompt alone, whatever else shares the batch. Handlers talk to the engine through
`submit` and the request's event queue (thread-safe callbacks).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .generate import check_finite, compile_decode_step, decode_step, make_cache, prefill

_ids = itertools.count()


@dataclass(eq=False)  # requests compare by identity (queue removal)
class Request:
    """One completion. `emit(kind, payload)` is called from the engine thread: ("text", str) for
    new text, then ("done", finish_reason) or ("error", message)."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters of the decoded completion already emitted
    cancelled: bool = False
    generator: Optional[torch.Generator] = None
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: Optional[float] = None


class Engine:
    def __init__(self, model, tokenizer, *, method: str, kivi_config, slots: int, max_seq_len: int,
                 compile: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.max_seq_len = slots, max_seq_len
        self.device = model.device
        self.cache = make_cache(model, method=method, batch_size=slots, max_seq_len=max_seq_len,
                                kivi_config=kivi_config)
        self.staging = make_cache(model, method=method, batch_size=1, max_seq_len=max_seq_len, kivi_config=kivi_config)
        self.step_fn = compile_decode_step(self.device) if compile else decode_step
        eos = tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.rows: list[Optional[Request]] = [None] * slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.generated_tokens = 0
        self.started_s = time.perf_counter()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="kivi-engine", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- handler side

    def submit(self, request: Request) -> None:
        """Queue a request (FIFO). Raises ValueError when it can never fit a slot."""
        need = len(request.prompt_ids) + request.max_tokens
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if need > self.max_seq_len:
            raise ValueError(f"the prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) = "
                             f"{need} exceeds a slot's capacity of {self.max_seq_len} tokens (--max-seq-len)")
        if request.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
        with self.lock:
            self.waiting.append(request)
            self.lock.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: the engine frees its row (or drops it from the queue) next."""
        with self.lock:
            request.cancelled = True
            if request in self.waiting:
                self.waiting.remove(request)
            self.lock.notify()

    def stats(self) -> dict:
        with self.lock:
            running = sum(r is not None for r in self.rows)
            elapsed = time.perf_counter() - self.started_s
            return dict(running=running, waiting=len(self.waiting), slots_used=running, slots_free=self.slots - running,
                        cache_bytes=self.cache.nbytes(), generated_tokens=self.generated_tokens,
                        tokens_per_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0)

    def close(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join(timeout=30)

    # ---------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not any(self.rows):
                    self.lock.wait()
                if self.stopping:
                    return
                self._drop_cancelled()
                admitted = []
                for slot in range(self.slots):
                    if self.rows[slot] is None and self.waiting:
                        self.rows[slot] = self.waiting.popleft()
                        admitted.append(slot)
            try:
                with torch.inference_mode():
                    if admitted:
                        self._prefill(admitted)
                    if any(r is not None for r in self.rows):
                        self._decode()
            except Exception as e:  # a failing step must not take the server down: fail its requests
                self._fail_all(f"{type(e).__name__}: {e}")

    def _drop_cancelled(self) -> None:
        for slot, r in enumerate(self.rows):
            if r is not None and r.cancelled:
                self.rows[slot] = None

    def _prefill(self, admitted: list[int]) -> None:
        logits = []
        for slot in admitted:
            ids = self.rows[slot].prompt_ids
            self.staging.reset()
            input_ids = torch.tensor([ids], device=self.device)
            counts = torch.tensor([len(ids)], device=self.device)
            logits.append(prefill(self.model, self.staging, input_ids, counts)[0])
            self.cache.load_row(slot, self.staging)
        self._advance(check_finite(torch.stack(logits), "the prompt"), admitted)

    def _decode(self) -> None:
        B = self.slots
        active = [s for s in range(B) if self.rows[s] is not None]
        tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        counts = torch.zeros(B, dtype=torch.long, device=self.device)
        for s in active:
            tokens[s] = self.rows[s].tokens[-1]
            counts[s] = 1
        positions = self.cache.lengths().clone()
        logits = self.step_fn(self.model, self.cache, tokens, positions, counts)
        self._advance(check_finite(logits[active], "a decode step"), active)

    def _advance(self, logits: torch.Tensor, slots: list[int]) -> None:
        """logits [len(slots), V], row i for slots[i]: sample each row's next token and emit it;
        finish rows that are done."""
        for row_logits, slot in zip(logits, slots):
            r = self.rows[slot]
            if r is None or r.cancelled:
                self.rows[slot] = None
                continue
            token = self._sample(row_logits, r)
            r.tokens.append(token)
            if r.first_token_s is None:
                r.first_token_s = time.perf_counter()
            self.generated_tokens += 1
            reason = self._emit_text(r, final=token in self.eos or len(r.tokens) >= r.max_tokens)
            if reason is None and token in self.eos:
                reason = "stop"
            elif reason is None and len(r.tokens) >= r.max_tokens:
                reason = "length"
            if reason is not None:
                r.emit("done", reason)
                with self.lock:
                    self.rows[slot] = None

    def _sample(self, logits: torch.Tensor, r: Request) -> int:
        if r.temperature == 0:
            return int(logits.argmax())
        probs = (logits.float() / r.temperature).softmax(dim=-1)
        if r.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(dim=-1) - sorted_probs < r.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=r.generator))

    def _emit_text(self, r: Request, final: bool) -> Optional[str]:
        """Emit the completion's new text. Returns "stop" when a stop string appeared (the text is
        cut before it). Text that could still become a stop string is held back until it cannot."""
        generated = [t for t in r.tokens if t not in self.eos]
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        for stop in r.stop:
            at = text.find(stop)
            if at != -1:
                if at > r.text_sent:
                    r.emit("text", text[r.text_sent:at])
                r.text_sent = at
                return "stop"
        hold = 0 if final else max((len(s) - 1 for s in r.stop), default=0)
        if text.endswith("\ufffd") and not final:  # an incomplete UTF-8 character: wait for the rest
            hold = max(hold, 1)
        upto = max(len(text) - hold, r.text_sent)
        if upto > r.text_sent:
            r.emit("text", text[r.text_sent:upto])
            r.text_sent = upto
        return None

    def _fail_all(self, message: str) -> None:
        with self.lock:
            for slot, r in enumerate(self.rows):
                if r is not None:
                    r.emit("error", message)
                    self.rows[slot] = None
