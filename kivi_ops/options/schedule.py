"""When tokens leave full precision (docs/cache.md, "Flush policies"): with flush unit F and kept
window K, tokens [0, F * floor(max(L - K, 0) / F)) are quantized and the rest sit in a residual ring
at slot t % W. kivi: keys F=R, K=0; values F=1, K=R; W=R. ott: both F=G, K=R; W=R+G-1. Static-shape
tensor code; the Triton kernels inline the same formulas."""

from __future__ import annotations

import torch
from torch import Tensor

POLICIES = ("kivi", "ott")
KIVI, OTT = 0, 1


def policy_id(name: str) -> int:
    if name not in POLICIES:
        raise ValueError(f"flush_policy must be one of {POLICIES}, got {name!r}")
    return POLICIES.index(name)


def check_policy_id(policy: int) -> None:
    if isinstance(policy, bool) or policy not in (KIVI, OTT):
        raise ValueError(f"flush_policy must be {KIVI} (kivi) or {OTT} (ott), got {policy!r}")


def residual_slots(policy: int, residual_length: int, group_size: int) -> int:
    """W: the ring's logical size (the layer stores min(W, max_seq_len) rows)."""
    return residual_length + group_size - 1 if policy == OTT else residual_length


def key_flush_unit(policy: int, residual_length: int, group_size: int) -> int:
    """Keys quantized together at one flush (and the OTT selection's window)."""
    return group_size if policy == OTT else residual_length


def quantized_counts(lengths: Tensor, residual_length: int, group_size: int = 1, policy: int = KIVI):
    """(quantized keys, quantized values) per sequence."""
    R, G = residual_length, group_size
    if policy == OTT:
        nq = torch.div((lengths - R).clamp(min=0), G, rounding_mode="floor") * G
        return nq, nq
    nqk = torch.div(lengths, R, rounding_mode="floor") * R
    nqv = (lengths - R).clamp(min=0)
    return nqk, nqv


def quantized_count_int(L: int, residual_length: int, group_size: int, policy: int) -> tuple[int, int]:
    R, G = residual_length, group_size
    if policy == OTT:
        nq = max(L - R, 0) // G * G
        return nq, nq
    return L // R * R, max(L - R, 0)
