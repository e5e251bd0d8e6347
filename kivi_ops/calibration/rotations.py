"""Calibrated rotations: per layer and KV head, the CANDIDATES matrix (identity, Hadamard, the PCA
eigenbasis, PCA then Hadamard) with the least Fisher-weighted KIVI quantization error, optionally refined
by gradient descent on that error ("learned"), chosen by `kivi calibrate` and stored in the calibration file."""

from __future__ import annotations

import base64
import hashlib
import json
from functools import partial
from pathlib import Path

import torch

from ..kernels.reference.packing import token_group_size
from ..ops.quantized import fake_quantize
from .nuq import _grouped, _ungrouped, calibrate_levels, fake_quantize_nuq
from ..options.rotation import CalibratedRotations, rotation_matrix

CANDIDATES = ("identity", "hadamard", "pca", "pca_hadamard")
FIXED = {"identity": lambda D: torch.eye(D), "hadamard": lambda D: rotation_matrix("hadamard", D)}
LEARNED = "learned"
FORMAT = "kivi-rotations-v1"
# Adam on the skew-symmetric generator of start @ expm(A - A^T): 150 steps at 1e-2 reach most of the
# gain on SmolLM2's heads; the error on held-out windows, checked every LEARN_CHECK steps, picks the step.
LEARN_STEPS, LEARN_RATE, LEARN_CHECK = 150, 1e-2, 10
# config.json fields that fix a model's attention shapes and weights' layout: the fingerprint
IDENTITY_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "intermediate_size", "vocab_size", "rope_theta")
# |M M^T - I| of a stored fp32 matrix: fp32 rounding of D-term sums is ~1e-6; a wrong matrix is ~1
ORTHOGONAL_ATOL = 1e-4


def model_identity(hf_config: dict, name: str) -> dict:
    """What a rotations file is checked against: name, head_dim, layer and KV head counts, fingerprint."""
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    shape = {k: hf_config.get(k) for k in IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    return dict(name=name, fingerprint=digest, head_dim=int(head_dim), num_layers=int(hf_config["num_hidden_layers"]),
                num_kv_heads=int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]))


def read_section(path, field: str, fmt: str, identity: dict | None, *, flag: str, hint: str) -> dict:
    """The calibration file's section `field`, refused when missing or calibrated for another model."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read a calibration file ({e})") from None
    section = data.get(field) if isinstance(data, dict) else None
    if not isinstance(section, dict) or section.get("format") != fmt:
        raise ValueError(f"{flag} {path}: the field '{field}' (format {fmt!r}) is missing; re-create the file {hint}")
    stored = section.get("model")
    if not isinstance(stored, dict):
        raise ValueError(f"{flag} {path}: the field '{field}.model' (the model's identity) is missing")
    if identity is not None:
        for key in ("head_dim", "num_layers", "num_kv_heads", "fingerprint"):
            if stored.get(key) != identity[key]:
                raise ValueError(f"{flag} {path}: {field}.model.{key} is {stored.get(key)!r} (calibrated for model "
                                 f"{stored.get('name')!r}), but the model {identity['name']!r} has {identity[key]!r}; "
                                 "calibrate this model with `kivi calibrate`")
    return section


def candidate_matrices(x: torch.Tensor) -> dict[str, torch.Tensor]:
    D = x.shape[-1]
    flat = x.reshape(-1, D).double()
    cov = torch.cov(flat.T)
    _, vectors = torch.linalg.eigh(cov)
    pca = vectors.flip(-1).float()
    hadamard = FIXED["hadamard"](D)
    return dict(identity=FIXED["identity"](D), hadamard=hadamard, pca=pca, pca_hadamard=pca @ hadamard)


def _axis_group(group_size: int, x: torch.Tensor, axis: str) -> int:
    """The group a per-channel (G tokens) or per-token (min(G, head_dim) channels) quantizer uses."""
    return token_group_size(group_size, x.shape[-1]) if axis == "token" else group_size


def quantization_error(x: torch.Tensor, fisher: torch.Tensor, m: torch.Tensor, *, bits: int, group_size: int,
                       axis: str, levels: torch.Tensor | None = None) -> float:
    """sum(fisher * (x - Q(x M) M^T)^2): KIVI's quantization error in the rotated basis, on the uniform
    grid or on nuq `levels` (fitted in that basis)."""
    G = _axis_group(group_size, x, axis)
    rotated = (x @ m).contiguous()
    q = fake_quantize(rotated, bits, G, axis) if levels is None else fake_quantize_nuq(rotated, bits, G, axis, levels)
    err = q @ m.T - x
    return float((fisher * err * err).sum())


def straight_through_quantize(y: torch.Tensor, *, bits: int, group: int, axis: str) -> torch.Tensor:
    """y [..., T, D] quantized on the uniform grid and dequantized, differentiable: rounding passes the
    gradient straight through, so it flows through each group's range (min and max)."""
    g = _grouped(y, group, axis)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=torch.finfo(torch.float32).tiny)
    n = (g - lo) / scale
    return _ungrouped(g + scale * (n.round().clamp(0, 2**bits - 1) - n).detach(), y.shape, axis)


def _surrogate_error(x, fisher, m, *, bits: int, group: int, axis: str) -> torch.Tensor:
    """quantization_error on the uniform grid, differentiable in m."""
    err = straight_through_quantize(x @ m, bits=bits, group=group, axis=axis) @ m.T - x
    return (fisher * err * err).sum()


def refined(start: torch.Tensor, generator: torch.Tensor) -> torch.Tensor:
    """start @ expm(A - A^T) for the generator A (batched over leading dims): orthogonal when start is."""
    return start @ torch.linalg.matrix_exp(generator - generator.transpose(-1, -2))


def learned_rotation(x: torch.Tensor, fisher: torch.Tensor, start: torch.Tensor, *, bits: int, group_size: int,
                     axis: str, steps: int = LEARN_STEPS) -> tuple[torch.Tensor, float, float]:
    """start refined by Adam on the Fisher-weighted error over the first 3/4 of the windows x [N, T, D]
    (N >= 2); the step with the least error on the last 1/4 (held out) is kept. Returns (matrix, its
    held-out error, start's held-out error)."""
    hold = max(1, x.shape[0] // 4)
    fit_x, fit_f, held_x, held_f = x[:-hold], fisher[:-hold], x[-hold:], fisher[-hold:]
    group = _axis_group(group_size, x, axis)
    held = partial(quantization_error, held_x, held_f, bits=bits, group_size=group_size, axis=axis)
    best, best_error = start, held(start)
    start_error = best_error
    generator = torch.zeros_like(start, requires_grad=True)
    optimizer = torch.optim.Adam([generator], lr=LEARN_RATE)
    norm = max(float(_surrogate_error(fit_x, fit_f, start, bits=bits, group=group, axis=axis)), 1e-30)
    for step in range(1, steps + 1):
        with torch.enable_grad():
            loss = _surrogate_error(fit_x, fit_f, refined(start, generator), bits=bits, group=group, axis=axis) / norm
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if step % LEARN_CHECK == 0:
            with torch.no_grad():
                m = refined(start, generator)
            error = held(m)
            if error < best_error:
                best, best_error = m, error
    return best.detach(), best_error, start_error


def _error_on_fitted_levels(x, grad, fisher, m, *, bits: int, group_size: int, axis: str) -> float:
    """quantization_error on nuq levels fitted to this head in m's basis (its gradients turned by m)."""
    levels = calibrate_levels(x @ m, (grad @ m) ** 2, bits, _axis_group(group_size, x, axis), axis)
    return quantization_error(x, fisher, m, bits=bits, group_size=group_size, axis=axis, levels=levels)


def choose_rotations(activations: list[dict], *, bits: int, group_size: int, nuq: bool = False,
                     learn: bool = False, progress=None) -> dict:
    """Per layer {"k": [per head {"kind", "matrix", "error_vs_identity"}], "v": [...]}; nuq: each candidate's
    error on levels fitted to it (for a cache with nuq levels), else on the uniform grid. learn: the best
    candidate refined by learned_rotation, kept where it lowers the held-out windows' error."""
    if learn and activations and activations[0]["k"].shape[0] < 2:
        raise ValueError("learned rotations hold out a quarter of the calibration windows: give --windows 2 or more")
    layers = []
    for act in activations if progress is None else progress(activations, "rotations"):
        entry = {}
        for part, axis in (("k", "channel"), ("v", "token")):
            heads = []
            for h in range(act[part].shape[1]):
                x, w = act[part][:, h], act[f"{part}_fisher"][:, h]
                options = candidate_matrices(x)
                error = (partial(_error_on_fitted_levels, x, act[f"{part}_grad"][:, h], w) if nuq
                         else partial(quantization_error, x, w))
                errors = {name: error(m, bits=bits, group_size=group_size, axis=axis) for name, m in options.items()}
                best = min(errors, key=errors.get)
                if learn:
                    m, learned_error, start_error = learned_rotation(x, w, options[best], bits=bits,
                                                                     group_size=group_size, axis=axis)
                    options[LEARNED] = m
                    errors[LEARNED] = error(m, bits=bits, group_size=group_size, axis=axis)
                    best = LEARNED if learned_error < start_error else best
                heads.append(dict(kind=best, matrix=options[best],
                                  error_vs_identity={n: round(e / max(errors["identity"], 1e-30), 4)
                                                     for n, e in errors.items()}))
            entry[part] = heads
        layers.append(entry)
    return dict(bits=bits, group_size=group_size, nuq=nuq, learned=learn, layers=layers)


def _stacked(chosen: dict, part: str) -> torch.Tensor:
    return torch.stack([torch.stack([h["matrix"] for h in layer[part]]) for layer in chosen["layers"]])


def rotations_digest(chosen: dict) -> str:
    """The digest the chosen rotations have once stored and loaded (CalibratedRotations.digest)."""
    return CalibratedRotations(_stacked(chosen, "k"), _stacked(chosen, "v"), "chosen").digest


def rotated_activations(activations: list[dict], chosen: dict) -> list[dict]:
    """The activations in the chosen rotations' basis, per head x M: the gradients turn the same way (M is
    orthogonal), so the Fisher weights are the rotated gradients squared."""
    out = []
    for act, layer in zip(activations, chosen["layers"]):
        entry = {}
        for part in ("k", "v"):
            m = torch.stack([h["matrix"] for h in layer[part]])  # [H, D, D]
            entry[part] = torch.einsum("nhtd,hde->nhte", act[part], m)
            entry[f"{part}_fisher"] = torch.einsum("nhtd,hde->nhte", act[f"{part}_grad"], m) ** 2
        out.append(entry)
    return out


def _encode(m: torch.Tensor) -> str:
    return base64.b64encode(m.contiguous().to(torch.float32).numpy().astype("<f4").tobytes()).decode()


def rotations_section(chosen: dict, identity: dict, *, keys_pre_rope: bool = False) -> dict:
    """The file's "rotations" field: per head the kind, its errors and the fitted matrix (base64 fp32)."""
    def head(h):  # identity and Hadamard are rebuilt on load
        entry = dict(kind=h["kind"], error_vs_identity=h["error_vs_identity"])
        return entry if h["kind"] in FIXED else dict(entry, matrix=_encode(h["matrix"]))

    layers = [{part: [head(h) for h in layer[part]] for part in ("k", "v")} for layer in chosen["layers"]]
    return dict(format=FORMAT, model=identity, bits=chosen["bits"], group_size=chosen["group_size"],
                keys_pre_rope=keys_pre_rope,
                objective="Fisher-weighted squared error of KIVI quantization on "
                          + ("nuq levels fitted to each candidate" if chosen.get("nuq") else "the uniform grid"),
                candidates=list(CANDIDATES) + ([LEARNED] if chosen.get("learned") else []),
                layers=layers)


def load_rotations(path, identity: dict | None, *, keys: bool = True, flag: str = "--rotations") -> CalibratedRotations:
    """The rotations of a `kivi calibrate` file, refused for another model, or for keys fitted before
    RoPE (the cache rotates post-RoPE keys)."""
    section = read_section(path, "rotations", FORMAT, identity, flag=flag,
                           hint="with `kivi calibrate` (which fits the rotations unless --no-rotations)")
    stored = section["model"]
    if keys and section.get("keys_pre_rope"):
        raise ValueError(f"{flag} {path}: rotations.keys_pre_rope is true (calibrated with --pre-rope): its key "
                         "rotations fit pre-RoPE keys, the cache rotates post-RoPE ones; calibrate without --pre-rope")
    D, L, H = stored.get("head_dim"), stored.get("num_layers"), stored.get("num_kv_heads")
    layers = section.get("layers")
    if not isinstance(layers, list) or len(layers) != L:
        raise ValueError(f"{flag} {path}: rotations.layers must list {L} layers (rotations.model.num_layers)")
    parts = {"k": [], "v": []}
    for i, layer in enumerate(layers):
        for part in parts:
            heads = layer.get(part) if isinstance(layer, dict) else None
            if not isinstance(heads, list) or len(heads) != H:
                raise ValueError(f"{flag} {path}: rotations.layers[{i}].{part} must list {H} heads")
            for j, head in enumerate(heads):
                where = f"rotations.layers[{i}].{part}[{j}].matrix"
                if isinstance(head, dict) and "matrix" not in head and head.get("kind") in FIXED:
                    parts[part].append(FIXED[head["kind"]](D))
                    continue
                try:
                    raw = base64.b64decode(head["matrix"], validate=True)
                    m = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(D, D)
                except (KeyError, TypeError, ValueError, RuntimeError) as e:
                    raise ValueError(f"{flag} {path}: {where} must be {D}x{D} base64 fp32 ({e})") from None
                if not bool(torch.isfinite(m).all()) or not torch.allclose(m @ m.T, torch.eye(D), atol=ORTHOGONAL_ATOL):
                    raise ValueError(f"{flag} {path}: {where} is not an orthogonal matrix")
                parts[part].append(m)
    shape = (L, H, D, D)
    return CalibratedRotations(torch.stack(parts["k"]).reshape(shape), torch.stack(parts["v"]).reshape(shape), str(path))
