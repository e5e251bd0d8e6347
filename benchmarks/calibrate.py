"""`kivi calibrate`: KVQuant's offline calibration of per-layer nuqX levels (kivi_ops/nuq.py).

Runs the model teacher-forced over real text with gradients, records every layer's keys and
values as attention receives them (keys after RoPE: this cache quantizes post-RoPE keys) and the
gradient of the summed next-token loss with respect to them, whose square is the diagonal Fisher
information (KVQuant Appendix D). Each layer's levels then come from a Fisher-weighted k-means
on the normalized values (Appendix E). Offline: the levels. Online, at quantization time: each
group's scale and zero point (min/max), as in KIVI.

The calibration text is taken from the *end* of the corpus, the evaluation windows
(`kivi eval`) from its beginning, so the two never overlap.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kivi_ops.nuq import (FORMAT, KEY_AXIS, VALUE_AXIS, calibrate_levels, load_tables,  # noqa: F401 (load_tables: API)
                          normalized_with_weights, uniform_levels, weighted_error)
from kivi_ops.rope import model_rope_tables, undo_rope

from kivi_models.cli_args import fraction_arg, positive_int, usage_errors

CALIB_ATTN = "kivi_calibrate"


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA that keeps this layer's keys/values and, after backward, their gradients."""
    record = module.config.kivi_calibration_record[module.layer_idx]
    record["k"].append(key.detach())
    record["v"].append(value.detach())
    key.register_hook(lambda g: record["k_grad"].append(g.detach()))
    value.register_hook(lambda g: record["v_grad"].append(g.detach()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CALIB_ATTN, _recording_attention)
AttentionMaskInterface.register(CALIB_ATTN, sdpa_mask)


def calibration_windows(tokenizer, text: str, *, window: int, windows: int) -> torch.Tensor:
    """The last `windows` non-overlapping windows of the text's tokens [windows, window]."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < window * windows:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {windows} windows of {window}")
    return torch.tensor(ids[len(ids) - window * windows:]).reshape(windows, window)


def collect_kv_fisher(model, windows: torch.Tensor, *, batch_size: int = 2, pre_rope: bool = False) -> list[dict]:
    """Per layer: keys, values [N, H, T, D] (fp32) and their squared loss gradients. pre_rope: the
    keys as they were before RoPE, with the gradient with respect to them (RoPE is a rotation R per
    position: k_pre = R^T k, dL/dk_pre = R^T dL/dk, so both are un-rotated)."""
    layers = model.config.num_hidden_layers
    record = [dict(k=[], v=[], k_grad=[], v_grad=[]) for _ in range(layers)]
    previous = model.config._attn_implementation
    model.config.kivi_calibration_record = record
    model.config._attn_implementation = CALIB_ATTN
    params = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)  # gradients of activations only, no weight gradients
    try:
        for i in tqdm(range(0, len(windows), batch_size), desc="calibration forward+backward", leave=False):
            win = windows[i : i + batch_size].to(model.device)
            embeds = model.get_input_embeddings()(win).detach().requires_grad_(True)
            with torch.enable_grad():
                logits = model(inputs_embeds=embeds, use_cache=False).logits[:, :-1]
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1),
                                       reduction="sum")
                loss.backward()
    finally:
        model.config._attn_implementation = previous
        del model.config.kivi_calibration_record
        for p, flag in zip(model.parameters(), params):
            p.requires_grad_(flag)
    if pre_rope:
        cos, sin = (t.float() for t in model_rope_tables(model, windows.shape[1]))
    out = []
    for r in record:
        # Hooks fire in backward order within a batch: one gradient per recorded batch either way.
        k, k_grad = torch.cat(r["k"]).float(), torch.cat(r["k_grad"]).float()
        if pre_rope:
            k, k_grad = undo_rope(k, cos, sin), undo_rope(k_grad, cos, sin)
        out.append(dict(k=k, v=torch.cat(r["v"]).float(), k_fisher=k_grad**2,
                        v_fisher=torch.cat(r["v_grad"]).float() ** 2))
    return out


def calibrate_tables(activations: list[dict], *, bits_list, group_size: int, sparse_outliers: float = 0.0) -> dict:
    """{bits: {"k": [levels per layer], "v": [...], "k_error_vs_uniform": [...], ...}}: the
    weighted error of each layer's levels relative to the uniform grid's (< 1 is better)."""
    tables = {}
    for bits in bits_list:
        entry = {"k": [], "v": [], "k_error_vs_uniform": [], "v_error_vs_uniform": []}
        for layer in tqdm(activations, desc=f"nuq{bits} k-means", leave=False):
            for part, axis in (("k", KEY_AXIS), ("v", VALUE_AXIS)):
                x, fisher = layer[part], layer[f"{part}_fisher"]
                levels = calibrate_levels(x, fisher, bits, group_size, axis, outlier_fraction=sparse_outliers)
                x_n, weights = normalized_with_weights(x, fisher, bits, group_size, axis, sparse_outliers)
                ratio = weighted_error(x_n, weights, levels) / max(weighted_error(x_n, weights, uniform_levels(bits)),
                                                                   torch.finfo(torch.float32).tiny)
                entry[part].append([round(float(v), 6) for v in levels])
                entry[f"{part}_error_vs_uniform"].append(round(ratio, 4))
        tables[str(bits)] = entry
    return tables


def run_calibration(model, tokenizer, text: str, *, bits_list, group_size: int, window: int, windows: int,
                    model_name: str, batch_size: int = 2, pre_rope: bool = False,
                    sparse_outliers: float = 0.0) -> dict:
    start = time.perf_counter()
    win = calibration_windows(tokenizer, text, window=window, windows=windows)
    activations = collect_kv_fisher(model, win, batch_size=batch_size, pre_rope=pre_rope)
    tables = calibrate_tables(activations, bits_list=bits_list, group_size=group_size, sparse_outliers=sparse_outliers)
    return dict(format=FORMAT, model=model_name, num_layers=len(activations), group_size=group_size,
                key_axis=KEY_AXIS, value_axis=VALUE_AXIS, pre_rope=pre_rope, sparse_outliers=sparse_outliers,
                calibration=dict(corpus_part="last tokens", window=window, windows=windows,
                                 tokens=int(win.numel()), weighting="Fisher (squared loss gradient) x scale^2",
                                 seconds=round(time.perf_counter() - start, 1)),
                bits=tables)


def add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="derive per-layer nuqX levels offline (KVQuant), Fisher-weighted k-means")
    c.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    c.add_argument("--model", default="default")
    c.add_argument("--text", default=None, help="a text file (default: the pydoc corpus)")
    c.add_argument("--bits", type=_bits_list, default=[2, 4], help="comma-separated, from 2,4 (default 2,4)")
    c.add_argument("--group-size", type=positive_int, default=32)
    c.add_argument("--window", type=positive_int, default=512)
    c.add_argument("--windows", type=positive_int, default=8)
    c.add_argument("--pre-rope", action="store_true", help="levels for keys quantized before RoPE (KVQuant)")
    c.add_argument("--sparse-outliers", type=fraction_arg, default=0.0, metavar="FRACTION",
                   help="levels for the dense part when this fraction of each vector is kept exact (e.g. 0.01)")
    c.set_defaults(func=cmd_calibrate, parser=c)


def _bits_list(text: str) -> list[int]:
    import argparse

    try:
        bits = [int(x) for x in text.split(",") if x]
    except ValueError:
        bits = []
    if not bits or any(b not in (2, 4) for b in bits):
        raise argparse.ArgumentTypeError(f"expected comma-separated bit widths from 2,4, got {text!r}")
    return bits


def cmd_calibrate(args, parser) -> int:
    from kivi_models import load_model
    from kivi_ops.config import check_group_size

    from .corpus import load_text

    with usage_errors(parser, ValueError, OSError):
        check_group_size("--group-size", args.group_size)
        text = load_text(text_file=args.text, corpus=None if args.text else "pydoc")
    if args.window % args.group_size:
        parser.error(f"--window must be a multiple of --group-size={args.group_size}")
    model, tokenizer = load_model(args.model, dtype=torch.float32, device="cpu")
    with usage_errors(parser):
        result = run_calibration(model, tokenizer, text, bits_list=args.bits, group_size=args.group_size,
                                 window=args.window, windows=args.windows, model_name=args.model,
                                 pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for bits, entry in result["bits"].items():
        k, v = entry["k_error_vs_uniform"], entry["v_error_vs_uniform"]
        print(f"nuq{bits}: Fisher-weighted error vs the uniform grid, mean over {len(k)} layers: "
              f"keys {sum(k) / len(k):.3f}, values {sum(v) / len(v):.3f}")
    print(f"wrote {args.out} ({result['calibration']['tokens']} tokens, {result['calibration']['seconds']} s)")
    return 0
