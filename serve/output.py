"""What becomes of a step's logits: each request's next token, its text, and whether it ends."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from kivi_models.generate import sampling_probs

from .request import Failure, Request

log = logging.getLogger("kivi.serve")


def eos_token_set(tokenizer, eos_token_ids: Optional[set[int]] = None) -> set[int]:
    if eos_token_ids is not None:
        return set(eos_token_ids)
    eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def advance(logits: torch.Tensor, requests: list[Optional[Request]], tokenizer, eos: set[int],
            where: str) -> tuple[int, list[tuple[Request, Optional[Failure]]]]:
    """Sample and emit each request's next token: (tokens sampled, requests that end here)."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    sampled, ended = 0, []
    for row_logits, r, ok in zip(logits, requests, finite):
        if r is None:
            continue
        if r.cancelled:
            ended.append((r, None))
            continue
        if not ok:
            log.error("request %s: non-finite logits at %s", r.id, where)
            ended.append((r, Failure(500, f"the model produced non-finite logits (NaN or Inf) at {where}: the weights, "
                                          "the dtype (float16 overflow?) or the inputs hold non-finite values")))
            continue
        try:
            reason = add_token(r, sample(row_logits, r), tokenizer, eos)
        except Exception as e:
            log.exception("request %s: sampling failed", r.id)
            ended.append((r, Failure(500, f"sampling failed: {type(e).__name__}: {e}")))
            continue
        sampled += 1
        if reason is not None:
            r.emit("done", reason)
            ended.append((r, None))
    return sampled, ended


def sample(logits: torch.Tensor, r: Request) -> int:
    if r.temperature == 0:
        return int(logits.argmax())
    probs = sampling_probs(logits, r.temperature, top_p=r.top_p)
    return int(torch.multinomial(probs, 1, generator=r.generator))


def add_token(r: Request, token: int, tokenizer, eos: set[int]) -> Optional[str]:
    r.tokens.append(token)
    if r.first_token_s is None:
        r.first_token_s = time.perf_counter()
    reason = emit_text(r, tokenizer, eos, final=token in eos or len(r.tokens) >= r.max_tokens)
    if reason is None and token in eos:
        reason = "stop"
    elif reason is None and len(r.tokens) >= r.max_tokens:
        reason = "length"
    return reason


def emit_text(r: Request, tokenizer, eos: set[int], final: bool) -> Optional[str]:
    """Emit the new text, holding back what could still become a stop string; "stop" once one appears."""
    generated = [t for t in r.tokens if t not in eos]
    text = tokenizer.decode(generated, skip_special_tokens=True)
    found = [at for at in (text.find(stop) for stop in r.stop) if at != -1]
    if found:
        at = min(found)
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
