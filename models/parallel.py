"""Tensor parallelism through transformers' DistributedConfig: whole KV heads per rank (docs/parallel.md)."""

from __future__ import annotations

import contextlib
import os

import torch

# Subcommands that run under torchrun (serve: rank 0 serves, the others replay, serve/tp.py).
TP_COMMANDS = ("generate", "eval", "serve")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def distributed_config(device: str):
    n = world_size()
    if n == 1:
        return None
    from transformers.distributed import DistributedConfig

    if device == "cuda":  # one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return DistributedConfig(tp_size=n)


def check_tp_size(config, n: int) -> None:
    """Heads must split evenly: each rank takes whole KV heads (and their query groups)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if n > 1 and (kv_heads % n or heads % n):
        raise ValueError(
            f"--nproc-per-node {n} must divide the model's key/value heads ({kv_heads}) and attention heads "
            f"({heads}); use one of {[d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and heads % d == 0]}"
        )


def local_rows(weight: torch.Tensor) -> int:
    """Output features of a Linear weight held on this rank (a DTensor shard's local rows)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.shape[0]


def local_kv_heads(model) -> int:
    attn = model.model.layers[0].self_attn
    k_proj = getattr(attn, "k_proj", None)
    if k_proj is None or not hasattr(k_proj.weight, "to_local"):  # not sharded
        return model.config.num_key_value_heads
    return local_rows(k_proj.weight) // attn.head_dim


def tp_size(model) -> int:
    return model.config.num_key_value_heads // local_kv_heads(model)


def check_launch(command: str) -> None:
    """Under torchrun, refuse a command that cannot run tensor-parallel (before any work)."""
    n = world_size()
    if n > 1 and command not in TP_COMMANDS:
        raise ValueError(f"`kivi {command}` does not run under torchrun (WORLD_SIZE={n}); "
                         f"tensor parallelism covers: {', '.join('kivi ' + c for c in TP_COMMANDS)}")


@contextlib.contextmanager
def rank_zero_output():
    """Under torchrun only rank 0 writes stdout (every rank still writes errors)."""
    if is_main_process():
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield
