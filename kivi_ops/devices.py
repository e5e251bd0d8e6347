"""One meaning for a device a user names: `"cuda"` is the current CUDA device.

`torch.device("cuda")` has no index, but every tensor made on it reports one (`cuda:0`), and the
two compare unequal. A cache resolves the device it is given once, here, so that its buffers, the
block tables it checks and the devices it reports all carry the same index."""
from __future__ import annotations

import torch


def _current_index(device_type: str) -> int:
    """The index a tensor made on an index-less device of this type lands on."""
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "current_device"):
        raise ValueError(f"device {device_type!r} has no current device to resolve an index-less name against")
    return module.current_device()


def resolve_device(device: torch.device | str) -> torch.device:
    """torch.device(device), with the current index filled in for an index-less accelerator
    (`"cuda"` -> `cuda:0` on a process whose current device is 0). CPU and meta keep no index."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        device = torch.device(device.type, _current_index(device.type))
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether tensors on a and on b live on the same device (`cuda` and `cuda:0` do when 0 is the
    current device; `cuda:0` and `cuda:1` never do)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    return resolve_device(a) == resolve_device(b)
