"""Calibration text (windows from the end) and evaluation text (from the beginning): never overlapping."""

from __future__ import annotations

from pathlib import Path

import torch

CORPORA = ("pydoc",)


def load_text(*, text_file: str | None = None, corpus: str | None = None) -> str:
    if text_file is not None:
        return Path(text_file).read_text()
    if corpus == "pydoc":
        from pydoc_data.topics import topics

        # Sorted keys: the same text on every Python build that ships the same topics.
        return "\n\n".join(topics[k] for k in sorted(topics))
    raise ValueError(f"corpus must be one of {CORPORA} (or pass a text file), got {corpus!r}")


def token_windows(tokenizer, text: str, *, window: int, max_tokens: int) -> torch.Tensor:
    """Consecutive non-overlapping windows [N, window] from the first max_tokens tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return torch.tensor(ids[: n * window]).reshape(n, window)
