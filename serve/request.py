"""A completion request as the engine takes it, and how one ends without finishing.

`Request` carries what the client asked for (the prompt's tokens, max_tokens, sampling, stop
strings) and `emit`, the callback through which the engine thread answers; the engine keeps its
progress on it too (tokens so far, text sent, its place in host memory while swapped out).
`Failure` is an error a request ended with; `RequestError` is a refusal at submit().
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# Keys under which the runner keeps host copies (a swapped-out request's, a cached prefix's tail):
# unique per process, and the same on every rank since only rank 0 draws them.
HOST_KEYS = itertools.count()


@dataclass(frozen=True)
class Failure:
    """Why a request ended without finishing: the HTTP status a non-streamed reply carries, a
    message naming the cause, and OpenAI's error code."""

    status: int
    message: str
    code: str = "generation_failed"


class RequestError(ValueError):
    """submit() refuses a request: the HTTP status, OpenAI's error code, and the request field to
    blame ("prompt": the prompt, which a chat request calls "messages"; None: no field)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_value", param: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.code, self.param, self.headers = status, code, param, headers


def prompt_count(prompt_tokens: int, at_least: bool) -> str:
    """"12 tokens", "1 token", "at least 1 token" (at_least: a bound counted before tokenizing)."""
    return f"{'at least ' if at_least else ''}{prompt_tokens} token{'' if prompt_tokens == 1 else 's'}"


def context_error(prompt_tokens: int, max_tokens: int, max_seq_len: int, *,
                  at_least: bool = False) -> Optional[RequestError]:
    """The refusal of a prompt of `prompt_tokens` (at_least: a lower bound, counted before
    tokenizing) plus max_tokens that does not fit a slot of max_seq_len tokens, else None. It
    blames max_tokens when the prompt alone fits, the prompt otherwise."""
    if prompt_tokens + max_tokens <= max_seq_len:
        return None
    return RequestError(f"the prompt ({prompt_count(prompt_tokens, at_least)}) + max_tokens ({max_tokens}) exceeds a slot's capacity of "
                        f"{max_seq_len} tokens (--max-seq-len)", code="context_length_exceeded",
                        param="max_tokens" if prompt_tokens < max_seq_len else "prompt")


@dataclass(eq=False)  # requests compare by identity (queue removal)
class Request:
    """One completion. `emit(kind, payload)` is called from the engine thread: ("text", str) for
    new text, then ("done", finish_reason) or ("error", Failure)."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # random: ids reveal no traffic
    tokens: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters of the decoded completion already emitted
    cancelled: bool = False
    generator: Optional[torch.Generator] = None
    submitted_s: float = field(default_factory=time.perf_counter)
    deadline_s: Optional[float] = None  # perf_counter time after which it ends (request_timeout)
    first_token_s: Optional[float] = None
    saved: Optional[int] = None  # --paged, while swapped out: its page count (the runner holds the host copy)
    preemptions: int = 0
    key: int = field(default_factory=lambda: next(HOST_KEYS))  # names its host copy to the runner (every rank)
    prefix_keys: list = field(default_factory=list)  # --prefix-caching: keys of its prompt's chunk boundaries

