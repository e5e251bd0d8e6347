"""Devices a user names resolve to the ones tensors report (the H200 run: a paged cache built with
device="cuda" refused its own block table on cuda:0)."""
import pytest
import torch

from kivi_ops import devices
from kivi_ops.cache.paged import _check_block_table


@pytest.fixture
def current_cuda_1(monkeypatch):
    """A process whose current CUDA device is 1 (no GPU needed: only the index is asked for)."""
    monkeypatch.setattr(devices, "_current_index", lambda device_type: 1)


def test_an_index_less_accelerator_resolves_to_the_current_device(current_cuda_1):
    assert devices.resolve_device("cuda") == torch.device("cuda", 1)
    assert devices.resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert devices.resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit index is kept
    assert devices.resolve_device("cpu") == torch.device("cpu")


def test_same_device_compares_index_less_names_with_the_current_index(current_cuda_1):
    assert devices.same_device(torch.device("cuda", 1), torch.device("cuda"))
    assert devices.same_device("cuda", torch.device("cuda", 1))
    assert not devices.same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not devices.same_device("cuda:0", "cuda:1")
    assert not devices.same_device("cpu", "cuda:1")
    assert devices.same_device("cpu", torch.device("cpu"))


def test_the_block_table_check_compares_devices_by_what_they_name(current_cuda_1):
    # A CPU test cannot make a CUDA tensor: the comparison itself is checked above with torch.device
    # objects; here, that the check uses it and that a real mismatch still names both devices.
    table = torch.zeros((2, 3), dtype=torch.int32)
    assert _check_block_table(table, 2, 3, "cpu") is table
    with pytest.raises(ValueError, match=r"block_table must be an int32 tensor \[batch_size=2, max_pages_per_seq=3\] on"
                                          r" cuda.*on cpu"):
        _check_block_table(table, 2, 3, torch.device("cuda"))
