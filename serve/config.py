"""What one `kivi serve` runs with, in one object: the CLI builds a ServeConfig from its flags,
the Engine (engine.py) and the HTTP app (app.py) read theirs from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kivi_models.loading import DEFAULT_NAME
from kivi_ops import KIVIConfig
from .paged_options import PagedServing
from .watchdog import STALL_TIMEOUT, check_stall_timeout

MAX_REQUEST_BYTES = 1 << 20  # 1 MiB of JSON: far more text than a 2048-token context holds


@dataclass(frozen=True)
class ServeConfig:
    # The cache and its runner (runner.Runner): `slots` rows of max_seq_len tokens each, static, or
    # with `paging` rows sharing a pool of pages (block_manager.py); compile: the decode step.
    method: str
    kivi_config: Optional[KIVIConfig]
    slots: int
    max_seq_len: int
    paging: Optional[PagedServing] = None
    compile: bool = False
    # The engine: max_waiting requests queued for a slot at most, beyond them submit() refuses with
    # 503 (None: no bound); request_timeout seconds from submit() to a 504 (None: none);
    # stall_timeout seconds without progress, requests open, before /health says stalled
    # (watchdog.py); eos_token_ids end a completion (None: the tokenizer's; empty: none do).
    max_waiting: Optional[int] = None
    request_timeout: Optional[float] = None
    stall_timeout: float = STALL_TIMEOUT
    eos_token_ids: Optional[frozenset[int]] = None
    # The HTTP app: the model id clients ask for, the largest body (413 beyond), the API key
    # (None: none), the Host names answered (None: any), and whether /docs and /openapi.json exist.
    served_model_name: str = DEFAULT_NAME
    max_request_bytes: int = MAX_REQUEST_BYTES
    api_key: Optional[str] = None
    allowed_hosts: Optional[tuple[str, ...]] = None
    docs: bool = False

    def __post_init__(self):
        check_stall_timeout(self.stall_timeout)  # here, before any engine thread starts
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))

    def runner_options(self) -> dict:
        """The keywords of Runner (and tp.LeaderRunner): every rank builds the same cache from them."""
        return dict(method=self.method, kivi_config=self.kivi_config, slots=self.slots, max_seq_len=self.max_seq_len,
                    paging=self.paging, compile=self.compile)
