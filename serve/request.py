"""A completion request as the engine takes it, and how one ends without finishing."""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# Host-copy keys: unique per process, the same on every rank (only rank 0 draws them).
HOST_KEYS = itertools.count()


@dataclass(frozen=True)
class Failure:

    status: int
    message: str
    code: str = "generation_failed"


class RequestError(ValueError):
    """A refusal at submit(): HTTP status, OpenAI code, and the field to blame (None: none)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_value", param: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.code, self.param, self.headers = status, code, param, headers


def prompt_count(prompt_tokens: int, at_least: bool) -> str:
    return f"{'at least ' if at_least else ''}{prompt_tokens} token{'' if prompt_tokens == 1 else 's'}"


def context_error(prompt_tokens: int, max_tokens: int, max_seq_len: int, *,
                  at_least: bool = False) -> Optional[RequestError]:
    if prompt_tokens + max_tokens <= max_seq_len:
        return None
    return RequestError(f"the prompt ({prompt_count(prompt_tokens, at_least)}) + max_tokens ({max_tokens}) exceeds a slot's capacity of "
                        f"{max_seq_len} tokens (--max-seq-len)", code="context_length_exceeded",
                        param="max_tokens" if prompt_tokens < max_seq_len else "prompt")


@dataclass(eq=False)  # requests compare by identity (queue removal)
class Request:
    """`emit` runs on the engine thread: ("text", str)..., then ("done", reason) or ("error", Failure)."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # random: ids reveal no traffic
    tokens: list[int] = field(default_factory=list)
    text_sent: int = 0
    cancelled: bool = False
    generator: Optional[torch.Generator] = None
    submitted_s: float = field(default_factory=time.perf_counter)
    deadline_s: Optional[float] = None
    first_token_s: Optional[float] = None
    saved: Optional[int] = None
    preemptions: int = 0
    key: int = field(default_factory=lambda: next(HOST_KEYS))
    prefix_keys: list = field(default_factory=list)

