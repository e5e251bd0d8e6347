"""What one `kivi serve` runs with: the CLI builds it, the Engine and the app read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kivi_models.loading import DEFAULT_NAME
from kivi_ops import KIVIConfig
from .paged_options import PagedServing
from .watchdog import STALL_TIMEOUT, check_stall_timeout

MAX_REQUEST_BYTES = 1 << 20  # far more text than a 2048-token context holds


@dataclass(frozen=True)
class ServeConfig:
    # The cache and its runner (runner.Runner).
    method: str
    kivi_config: Optional[KIVIConfig]
    slots: int
    max_seq_len: int
    paging: Optional[PagedServing] = None
    compile: bool = False
    # The engine: None means no bound / no timeout; eos_token_ids None: the tokenizer's, empty: none.
    max_waiting: Optional[int] = None
    request_timeout: Optional[float] = None
    stall_timeout: float = STALL_TIMEOUT
    eos_token_ids: Optional[frozenset[int]] = None
    # The HTTP app.
    served_model_name: str = DEFAULT_NAME
    max_request_bytes: int = MAX_REQUEST_BYTES
    api_key: Optional[str] = None
    allowed_hosts: Optional[tuple[str, ...]] = None
    docs: bool = False

    def __post_init__(self):
        check_stall_timeout(self.stall_timeout)  # before any engine thread starts
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))

    def runner_options(self) -> dict:
        return dict(method=self.method, kivi_config=self.kivi_config, slots=self.slots, max_seq_len=self.max_seq_len,
                    paging=self.paging, compile=self.compile)
