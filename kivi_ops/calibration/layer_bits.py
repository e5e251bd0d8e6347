"""Per-layer bit widths under a bits budget, KVTuner-style (docs/cache.md, "Per-layer bit widths"): each
part's Fisher-weighted quantization error per width, then a greedy choice by error per byte."""

from __future__ import annotations

import dataclasses

import torch

from .rotations import quantization_error, read_section
from ..config import KIVIConfig, check_bits
from ..cache.layer import KIVILayer

FORMAT = "kivi-layer-bits-v1"
WIDTHS = (2, 3, 4)
PARTS = (("k", "channel"), ("v", "token"))


def sensitivities(activations: list[dict], *, group_size: int, widths=WIDTHS, rotations: dict | None = None,
                  levels: dict | None = None) -> list:
    """Per layer {"k": {bits: error}, "v": {...}}, summed over heads, in the rotations' basis if given, with
    the nuq levels if given (a levels file's "bits" table holding every width)."""
    out = []
    for i, act in enumerate(activations):
        entry = {}
        for part, axis in PARTS:
            H, D = act[part].shape[1], act[part].shape[-1]
            mats = ([h["matrix"] for h in rotations["layers"][i][part]] if rotations else [torch.eye(D)] * H)
            grid = {b: None if levels is None else torch.tensor(levels[str(b)][part][i]) for b in widths}
            entry[part] = {b: sum(quantization_error(act[part][:, h], act[f"{part}_fisher"][:, h], mats[h], bits=b,
                                                     group_size=group_size, axis=axis, levels=grid[b])
                                  for h in range(H))
                           for b in widths}
        out.append(entry)
    return out


def layer_nbytes(config: KIVIConfig, widths: tuple[int, int], *, tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Exact bytes of one full-attention layer at (k_bits, v_bits) holding one sequence of `tokens`."""
    cfg = dataclasses.replace(config, k_bits=widths[0], v_bits=widths[1], layer_bits=(), rotate_keys="none",
                              rotate_values="none", rotations=None)
    return KIVILayer(cfg, 0, batch_size=1, max_seq_len=tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=torch.float16, device="meta").nbytes()


def check_budget(config: KIVIConfig, *, budget: float, tokens: int, num_kv_heads: int, head_dim: int,
                 widths=WIDTHS) -> None:
    low = min(widths)
    least = 8 * layer_nbytes(config, (low, low), tokens=tokens, num_kv_heads=num_kv_heads,
                             head_dim=head_dim) / (2 * num_kv_heads * tokens * head_dim)
    if budget < least:
        raise ValueError(f"bits_budget={budget} is below the narrowest cache's {least:.4f} bits per element "
                         f"(every layer at {low} bits, group_size={config.group_size}, residual_length="
                         f"{config.residual_length}, at {tokens} tokens; scales, zeros and the fp window counted): "
                         "raise it, or a larger group_size or a smaller residual_length lowers the floor")


def choose_widths(sensitivity: list, full: list[bool], config: KIVIConfig, *, budget: float, tokens: int,
                  num_kv_heads: int, head_dim: int, widths=WIDTHS) -> tuple[tuple, float]:
    """(layer_bits, bits per element) within `budget`: lower the part whose error grows least per byte
    saved until it fits, then raise while it fits. Sliding-window layers get the narrowest (unused)."""
    widths = sorted(widths)
    for b in widths:
        check_bits("widths", b)
    size = {(k, v): layer_nbytes(config, (k, v), tokens=tokens, num_kv_heads=num_kv_heads, head_dim=head_dim)
            for k in widths for v in widths}
    layers = [i for i, f in enumerate(full) if f]
    if not layers:
        raise ValueError("the model has no full-attention layer whose widths a budget could choose")
    elements = 2 * len(layers) * num_kv_heads * tokens * head_dim
    bits = {i: {"k": widths[-1], "v": widths[-1]} for i in layers}

    def total():
        return 8 * sum(size[bits[i]["k"], bits[i]["v"]] for i in layers) / elements

    def move(i, part, to):
        now = dict(bits[i])
        after = dict(now, **{part: to})
        return (sensitivity[i][part][to] - sensitivity[i][part][now[part]],
                size[after["k"], after["v"]] - size[now["k"], now["v"]])

    def step(i, part, up):
        j = widths.index(bits[i][part]) + (1 if up else -1)
        return widths[j] if 0 <= j < len(widths) else None

    check_budget(config, budget=budget, tokens=tokens, num_kv_heads=num_kv_heads, head_dim=head_dim, widths=widths)
    while total() > budget:
        _, i, p, to = min((move(i, p, to)[0] / -move(i, p, to)[1], i, p, to) for i in layers for p in ("k", "v")
                          if (to := step(i, p, False)) is not None)
        bits[i][p] = to
    while True:
        options = [(move(i, p, to)[0] / move(i, p, to)[1], i, p, to) for i in layers for p in ("k", "v")
                   if (to := step(i, p, True)) is not None
                   and total() + 8 * move(i, p, to)[1] / elements <= budget]
        if not options:
            break
        _, i, p, to = min(options)
        bits[i][p] = to
    chosen = tuple((bits[i]["k"], bits[i]["v"]) if f else (widths[0], widths[0]) for i, f in enumerate(full))
    return chosen, total()


def layer_bits_section(chosen: tuple, sensitivity: list, identity: dict, *, budget: float, bits_per_element: float,
                       tokens: int, config: KIVIConfig, rotated: bool, full: list[bool], nuq: bool = False) -> dict:
    grid = "the file's nuq levels" if nuq else "the uniform grid"
    return dict(format=FORMAT, model=identity, budget=budget, bits_per_element=round(bits_per_element, 4),
                tokens=tokens, group_size=config.group_size, residual_length=config.residual_length, rotated=rotated,
                nuq=nuq, objective=f"Fisher-weighted squared error of KIVI quantization on {grid}, per layer and part",
                layers=[list(p) for p in chosen], full_attention=list(full),
                sensitivity=[{part: {str(b): e for b, e in s[part].items()} for part in ("k", "v")} for s in sensitivity])


def load_layer_bits(path, identity: dict | None, *, flag: str = "--layer-bits") -> tuple[tuple, dict]:
    """(layer_bits, the section) of a `kivi calibrate --bits-budget` file, refused for another model."""
    section = read_section(path, "layer_bits", FORMAT, identity, flag=flag, hint="with `kivi calibrate --bits-budget B`")
    layers = section.get("layers")
    L = section["model"].get("num_layers")
    if not isinstance(layers, list) or len(layers) != L:
        raise ValueError(f"{flag} {path}: layer_bits.layers must list {L} [k_bits, v_bits] pairs "
                         "(layer_bits.model.num_layers)")
    try:
        chosen = tuple(tuple(p) for p in layers)
        KIVIConfig(group_size=section["group_size"], residual_length=section["residual_length"], layer_bits=chosen)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{flag} {path}: layer_bits is not a valid set of widths ({e})") from None
    return chosen, section
