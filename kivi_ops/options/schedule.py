"""When tokens leave full precision: the cache's flush policy (KIVIConfig.flush_policy).

Two policies, one formula. For a sequence of L tokens, with flush unit F and kept window K,
    quantized(L) = F * floor(max(L - K, 0) / F)
tokens [0, quantized(L)) are quantized, the rest are exact in a residual ring in which token t
lives in slot t % W (W residual slots, capped at max_seq_len since t < max_seq_len).

    policy  stream   F   K   W          what it means
    kivi    keys     R   0   R          KIVI Algorithm 1: keys collect in an R-token residual and are
                                        quantized R at a time when it fills (R a multiple of G)
    kivi    values   1   R   R          the last R values are exact; the oldest is quantized as it leaves
    ott     both     G   R   R + G - 1  OTT (its Section 3.2 / 4.1): keys and values are quantized G
                                        at a time, every G steps, and the R most recent tokens always
                                        stay exact: the residual holds R .. R + G - 1 tokens once
                                        L >= R (fewer before); R and G are independent

Under `ott` a G-token group is quantized at the step that makes it the oldest G tokens of a
residual of R + G tokens, that is when L reaches R + k G for the group [(k-1) G, k G); keys and
values of a group are quantized together, from their exact copies in the residual ring (or the
appended tensor). The flush unit is also the OTT outlier selection's window (pool.py): R tokens
under `kivi`, G under `ott`.

These helpers are static-shape tensor code (the reference, the decomposed forms and the exports
use them); the Triton kernels inline the same formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor

POLICIES = ("kivi", "ott")
KIVI, OTT = 0, 1  # QuantParams.flush_policy (the ops' schemas take ints)


def policy_id(name: str) -> int:
    if name not in POLICIES:
        raise ValueError(f"flush_policy must be one of {POLICIES}, got {name!r}")
    return POLICIES.index(name)


def check_policy_id(policy: int) -> None:
    if isinstance(policy, bool) or policy not in (KIVI, OTT):
        raise ValueError(f"flush_policy must be {KIVI} (kivi) or {OTT} (ott), got {policy!r}")


def residual_slots(policy: int, residual_length: int, group_size: int) -> int:
    """W: the residual ring's logical size (the layer stores min(W, max_seq_len) rows)."""
    return residual_length + group_size - 1 if policy == OTT else residual_length


def key_flush_unit(policy: int, residual_length: int, group_size: int) -> int:
    """Keys quantized together at one flush (and the OTT selection's window)."""
    return group_size if policy == OTT else residual_length


def quantized_counts(lengths: Tensor, residual_length: int, group_size: int = 1, policy: int = KIVI):
    """(quantized keys, quantized values) per sequence: see the module doc."""
    R, G = residual_length, group_size
    if policy == OTT:
        nq = torch.div((lengths - R).clamp(min=0), G, rounding_mode="floor") * G
        return nq, nq
    nqk = torch.div(lengths, R, rounding_mode="floor") * R
    nqv = (lengths - R).clamp(min=0)
    return nqk, nqv


def quantized_count_int(L: int, residual_length: int, group_size: int, policy: int) -> tuple[int, int]:
    """quantized_counts for one Python int length (the reference's per-sequence loop)."""
    R, G = residual_length, group_size
    if policy == OTT:
        nq = max(L - R, 0) // G * G
        return nq, nq
    return L // R * R, max(L - R, 0)
