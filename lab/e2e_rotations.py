"""Calibrated rotations refined end to end (SpinQuant-style): every layer's and head's key and value
rotation trained jointly on the calibration windows' next-token loss, through a teacher-forced forward
that quantizes like the decode cache (KIVI's flush schedule: keys exact until their R-token block
flushes, values for their last R tokens; sink tokens exact; each layer at its file's widths, uniform
grid, rounding passed straight through). Starts from a `kivi calibrate --bits-budget` file, keeps its
widths, refits its nuq levels in the new basis, and writes a file the cache takes as it took the first.

    python -m lab e2e_rotations --start benchmarks/results/calibration_smollm2_bits3.json --out cal_e2e.json \
        --group-size 64 --residual-length 64 --sink-tokens 4 [--steps 60 --lr 2e-3]

The last quarter of the windows is held out: its loss, every --check steps, picks the step kept.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from kivi_ops.calibration.nuq import calibrate_tables, levels_file
from kivi_ops.calibration.rotations import (LEARNED, load_rotations, model_identity, refined, rotated_activations,
                                            rotations_digest, rotations_section, straight_through_quantize)
from kivi_ops.kernels.reference.packing import token_group_size
from kivi_ops.options.schedule import quantized_counts

ATTN = "kivi_e2e_rotations"


def _fake(x, m, bits: int, group: int, axis: str):
    """x [B, H, T, D] rotated per head by m [H, D, D], quantized, dequantized and rotated back."""
    y = straight_through_quantize(torch.einsum("bhtd,hde->bhte", x, m), bits=bits, group=group, axis=axis)
    return torch.einsum("bhte,hde->bhtd", y, m)


def _decode_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    state = module.config.kivi_e2e
    i = module.layer_idx
    k_bits, v_bits = state["widths"][i]
    mk, mv = state["matrices"](i)
    G, R, S = state["group_size"], state["residual_length"], state["sink_tokens"]
    T, D = key.shape[2], key.shape[3]
    kq = _fake(key, mk, k_bits, G, "channel")
    vq = _fake(value, mv, v_bits, token_group_size(G, D), "token")
    groups = query.shape[1] // key.shape[1]
    key, value, kq, vq = (t.repeat_interleave(groups, 1) for t in (key, value, kq, vq))
    pos = torch.arange(T)
    nqk, nqv = quantized_counts(pos + 1, R, G)  # after appending token i, as the decode step attends
    j = pos[None, :]
    key_exact = (j >= nqk[:, None]) | (j < S)
    value_exact = (j >= nqv[:, None]) | (j < S)
    scale = scaling if scaling is not None else D**-0.5
    scores = torch.where(key_exact, query @ key.transpose(-1, -2), query @ kq.transpose(-1, -2)) * scale
    scores = scores.masked_fill(j > pos[:, None], float("-inf"))
    p = scores.softmax(-1)
    out = (p * value_exact) @ value + (p * ~value_exact) @ vq
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN, _decode_attention)
AttentionMaskInterface.register(ATTN, sdpa_mask)


def _loss(model, windows):
    logits = model(input_ids=windows, use_cache=False).logits[:, :-1]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", required=True, help="a `kivi calibrate --bits-budget` file (rotations and widths)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="default")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--residual-length", type=int, default=64)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--check", type=int, default=10)
    p.add_argument("--bits", default="2,3,4", help="the nuq widths to refit")
    args = p.parse_args(argv)

    from kivi_models.calibrate import calibration_windows, collect_kv_fisher
    from kivi_models.corpus import load_text
    from kivi_models.loading import head_dim_of, load_model, model_identity as loaded_identity, resolve_model_path

    start_time = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=torch.float32, device="cpu")
    name = loaded_identity(args.model)
    identity = model_identity(json.loads((resolve_model_path(args.model) / "config.json").read_text()), name)
    start = json.loads(Path(args.start).read_text())
    rotations = load_rotations(args.start, identity)
    widths = [tuple(w) for w in start["layer_bits"]["layers"]]
    L, H, D = rotations.keys.shape[:3]
    windows = calibration_windows(tokenizer, load_text(text_file=None, corpus="pydoc"), window=args.window,
                                  windows=args.windows)
    hold = max(1, args.windows // 4)
    train, held = windows[:-hold], windows[-hold:]
    gen = {part: torch.zeros(L, H, D, D, requires_grad=True) for part in ("k", "v")}
    base = {"k": rotations.keys.float(), "v": rotations.values.float()}

    def matrices(i):
        return tuple(refined(base[part][i], gen[part][i]) for part in ("k", "v"))

    model.requires_grad_(False)
    model.config.kivi_e2e = dict(widths=widths, matrices=matrices, group_size=args.group_size,
                                 residual_length=args.residual_length, sink_tokens=args.sink_tokens)
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTN

    def held_loss():
        with torch.no_grad():
            return float(sum(_loss(model, held[b:b + 1]) for b in range(len(held))) / len(held))

    best_loss, best_step = held_loss(), 0
    best = {part: g.detach().clone() for part, g in gen.items()}
    print(f"step 0: held-out loss {best_loss:.4f}", flush=True)
    optimizer = torch.optim.Adam(list(gen.values()), lr=args.lr)
    history = [dict(step=0, held_loss=best_loss)]
    for step in tqdm(range(1, args.steps + 1), desc="end-to-end rotations"):
        b = ((step - 1) * args.batch) % len(train)
        batch = train[b:b + args.batch]
        with torch.enable_grad():
            loss = _loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if step % args.check == 0:
            h = held_loss()
            history.append(dict(step=step, train_loss=float(loss), held_loss=h))
            print(f"step {step}: train {float(loss):.4f}, held-out {h:.4f}", flush=True)
            if h < best_loss:
                best_loss, best_step = h, step
                best = {part: g.detach().clone() for part, g in gen.items()}
    model.config._attn_implementation = previous
    del model.config.kivi_e2e
    with torch.no_grad():
        for part in gen:
            gen[part].copy_(best[part])
        final = [matrices(i) for i in range(L)]
    chosen = dict(bits=start["rotations"]["bits"], group_size=args.group_size, nuq=False, learned=True,
                  layers=[{part: [dict(kind=LEARNED, matrix=m[h].contiguous(), error_vs_identity={}) for h in range(H)]
                           for part, m in zip(("k", "v"), final[i])} for i in range(L)])
    # nuq levels refit in the new basis, on the same windows
    activations = collect_kv_fisher(model, windows)
    bits_list = [int(b) for b in args.bits.split(",")]
    tables = calibrate_tables(rotated_activations(activations, chosen), bits_list=bits_list, group_size=args.group_size)
    data = levels_file(tables, model=name, num_layers=L, head_dim=head_dim_of(model.config), group_size=args.group_size,
                       levels_rotations=rotations_digest(chosen),
                       calibration=dict(start["calibration"], end_to_end=dict(
                           start=args.start, steps=args.steps, lr=args.lr, batch=args.batch, best_step=best_step,
                           held_out_windows=hold, sink_tokens=args.sink_tokens, residual_length=args.residual_length,
                           history=history, seconds=round(time.perf_counter() - start_time, 1))))
    data["rotations"] = rotations_section(chosen, identity)
    data["rotations"]["objective"] = ("next-token loss of a teacher-forced forward quantized as the decode cache "
                                      "(lab/e2e_rotations.py), from the start file's rotations")
    data["layer_bits"] = start["layer_bits"]
    with open(args.out, "w") as f:
        json.dump(data, f)
    print(f"best step {best_step}: held-out loss {best_loss:.4f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
