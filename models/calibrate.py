"""`kivi calibrate`: KVQuant's gradient-weighted nuqX levels, the calibrated rotations and per-layer widths."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kivi_ops.calibration.rotations import choose_rotations, rotated_activations, rotations_digest, rotations_section
from kivi_ops.config import KIVIConfig
from kivi_ops.calibration.layer_bits import check_budget, choose_widths, layer_bits_section, sensitivities
from kivi_ops.calibration.nuq import calibrate_tables, levels_file
from kivi_ops.options.rope import model_rope_tables, undo_rope

from .loading import head_dim_of
from .windows import layer_windows

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
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < window * windows:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {windows} windows of {window}")
    return torch.tensor(ids[len(ids) - window * windows:]).reshape(windows, window)


def collect_kv_fisher(model, windows: torch.Tensor, *, batch_size: int = 2, pre_rope: bool = False) -> list[dict]:
    """Per layer: keys, values [N, H, T, D] (fp32), their loss gradients and squared gradients. pre_rope: both
    un-rotated (RoPE is a rotation R per position: k_pre = R^T k, dL/dk_pre = R^T dL/dk)."""
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
    # Each layer's keys are un-rotated with its own RoPE table (Gemma 3: local and global ones).
    types = model.config.layer_types if hasattr(model.model.rotary_emb, "layer_types") else [None] * layers
    tables = {t: [x.float() for x in model_rope_tables(model, windows.shape[1], t)] for t in set(types) if pre_rope}
    out = []
    for r, layer_type in zip(record, types):
        # Hooks fire in backward order within a batch: one gradient per recorded batch either way.
        k, k_grad = torch.cat(r["k"]).float(), torch.cat(r["k_grad"]).float()
        if pre_rope:
            cos, sin = tables[layer_type]
            k, k_grad = undo_rope(k, cos, sin), undo_rope(k_grad, cos, sin)
        v_grad = torch.cat(r["v_grad"]).float()
        out.append(dict(k=k, v=torch.cat(r["v"]).float(), k_grad=k_grad, v_grad=v_grad, k_fisher=k_grad**2,
                        v_fisher=v_grad**2))
    return out


def run_calibration(model, tokenizer, text: str, *, bits_list, group_size: int, window: int, windows: int,
                    model_name: str, batch_size: int = 2, pre_rope: bool = False,
                    sparse_outliers: float = 0.0, rotation_bits: int | None = None,
                    identity: dict | None = None, bits_budget: float | None = None,
                    residual_length: int = 128, budget_tokens: int = 4096, budget_nuq: bool = False,
                    rotations_nuq: bool = False, learned_rotations: bool = False) -> dict:
    """The levels file for `model` from the last `windows` windows of `text`, with the rotations
    (rotation_bits) and per-layer widths (bits_budget, measured in the rotations' basis, with each width's
    fitted nuq levels if budget_nuq) when asked. With rotations (and post-RoPE keys) the levels are fitted
    in their basis."""
    if (rotation_bits is not None or bits_budget is not None) and identity is None:
        raise ValueError("rotation_bits and bits_budget need the model's identity (calibrated_rotation.model_identity)")
    budget_config = None
    if budget_nuq and (bits_budget is None or not {2, 3, 4} <= set(bits_list)):
        raise ValueError(f"--budget-nuq chooses widths by the nuq levels of every width: it needs --bits-budget and "
                         f"--bits 2,3,4, got --bits {','.join(map(str, bits_list))}"
                         + ("" if bits_budget is not None else " and no --bits-budget"))
    if bits_budget is not None:  # refused before the slow part
        budget_config = KIVIConfig(group_size=group_size, residual_length=residual_length)
        check_budget(budget_config, budget=bits_budget, tokens=budget_tokens, head_dim=head_dim_of(model.config),
                     num_kv_heads=model.config.num_key_value_heads)
    start = time.perf_counter()
    win = calibration_windows(tokenizer, text, window=window, windows=windows)
    activations = collect_kv_fisher(model, win, batch_size=batch_size, pre_rope=pre_rope)
    chosen = None if rotation_bits is None else choose_rotations(
        activations, bits=rotation_bits, group_size=group_size, nuq=rotations_nuq, learn=learned_rotations,
        progress=lambda items, desc: tqdm(items, desc=desc, leave=False))
    # The cache rotates post-RoPE keys only, so levels for pre-RoPE keys stay unrotated.
    levels_rotated = chosen is not None and not pre_rope
    tables = calibrate_tables(rotated_activations(activations, chosen) if levels_rotated else activations,
                              bits_list=bits_list, group_size=group_size, sparse_outliers=sparse_outliers,
                              progress=lambda items, desc: tqdm(items, desc=desc, leave=False))
    data = levels_file(tables, model=model_name, num_layers=len(activations), head_dim=head_dim_of(model.config),
                       group_size=group_size,
                       pre_rope=pre_rope, sparse_outliers=sparse_outliers,
                       levels_rotations=rotations_digest(chosen) if levels_rotated else None,
                       calibration=dict(corpus_part="last tokens", window=window, windows=windows,
                                        tokens=int(win.numel()), weighting="Fisher (squared loss gradient) x scale^2",
                                        seconds=round(time.perf_counter() - start, 1)))
    if chosen is not None:
        data["rotations"] = rotations_section(chosen, identity, keys_pre_rope=pre_rope)
    if bits_budget is not None:
        full = [w is None for w in layer_windows(model)]
        sensitivity = sensitivities(activations, group_size=group_size, rotations=chosen,
                                    levels=tables if budget_nuq else None)
        dims = dict(tokens=budget_tokens, num_kv_heads=activations[0]["k"].shape[1], head_dim=head_dim_of(model.config))
        widths, bits = choose_widths(sensitivity, full, budget_config, budget=bits_budget, **dims)
        data["layer_bits"] = layer_bits_section(widths, sensitivity, identity, budget=bits_budget, bits_per_element=bits,
                                                tokens=budget_tokens, config=budget_config, rotated=chosen is not None,
                                                full=full, nuq=budget_nuq)
    data["calibration"]["seconds"] = round(time.perf_counter() - start, 1)
    return data
