"""One meaning for a named device: torch.device("cuda") has no index but its tensors report one
(cuda:0), and the two compare unequal, so a cache resolves its device once, here."""
from __future__ import annotations

import torch


def _current_index(device_type: str) -> int:
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "current_device"):
        raise ValueError(f"device {device_type!r} has no current device to resolve an index-less name against")
    return module.current_device()


def resolve_device(device: torch.device | str) -> torch.device:
    """torch.device(device) with the current index filled in for an index-less accelerator."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        device = torch.device(device.type, _current_index(device.type))
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether tensors on a and b share a device (`cuda` and `cuda:0` do when 0 is current)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    return resolve_device(a) == resolve_device(b)
