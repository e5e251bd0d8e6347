"""KVQuant's nuqX datatype (docs/cache.md, "KVQuant"): per-layer levels the codes index, fitted
offline by a Fisher-weighted k-means, rescaled by KIVI's per-group scale and zero online."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import check_axis, check_bits, check_group_size, levels_ok, levels_rule
from ..options.dense_sparse import outlier_mask
from ..kernels.reference.packing import nearest_level, token_group_size


FORMAT = "kivi-nuq-v1"
KEY_AXIS, VALUE_AXIS = "channel", "token"


def uniform_levels(bits: int) -> torch.Tensor:
    return torch.arange(2**bits, dtype=torch.float32)


def check_levels(name: str, levels: torch.Tensor, bits: int) -> None:
    if not isinstance(levels, torch.Tensor) or levels.shape != (2**bits,) or not levels.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of {2**bits} levels for {bits}-bit codes, "
                         f"got {getattr(levels, 'shape', levels)}")
    if not levels_ok(levels.tolist(), bits):
        raise ValueError(f"{name} must be {levels_rule(bits)} (sorted, for {bits}-bit codes), got {levels.tolist()}")


def _grouped(x: torch.Tensor, group_size: int, axis: str) -> torch.Tensor:
    *lead, T, D = x.shape
    if axis == "channel":
        if T % group_size:
            raise ValueError(f"axis='channel' needs the token dim T={T} to be a multiple of group_size={group_size}")
        return x.reshape(*lead, T // group_size, group_size, D).transpose(-1, -2)
    gv = token_group_size(group_size, D)
    return x.reshape(*lead, T, D // gv, gv)


def _ungrouped(g: torch.Tensor, shape, axis: str) -> torch.Tensor:
    if axis == "channel":
        return g.transpose(-1, -2).reshape(shape)
    return g.reshape(shape)


def normalize_groups(x: torch.Tensor, bits: int, group_size: int, axis: str, exclude: torch.Tensor | None = None):
    """(x_n, scale, zero) grouped as _grouped, x_n in [0, 2^B - 1] (0 for a constant group); `exclude`d
    elements stay out of the min/max."""
    g = _grouped(x.float(), group_size, axis)
    if exclude is None:
        lo, hi = g, g
    else:
        e = _grouped(exclude, group_size, axis)
        lo, hi = g.masked_fill(e, float("inf")), g.masked_fill(e, float("-inf"))
    zero = lo.amin(dim=-1, keepdim=True)
    high = hi.amax(dim=-1, keepdim=True)
    everything_excluded = torch.isinf(zero)
    zero, high = zero.masked_fill(everything_excluded, 0.0), high.masked_fill(everything_excluded, 0.0)
    scale = (high - zero) / (2**bits - 1)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (g - zero) / safe, scale, zero


def fake_quantize_nuq(x: torch.Tensor, bits: int, group_size: int, axis: str, levels: torch.Tensor,
                      outlier_fraction: float = 0.0) -> torch.Tensor:
    """x [..., T, D] quantized to the nuq levels per group and dequantized, in x's dtype; an
    outlier_fraction of each vector stays exact (dense_sparse.outlier_mask)."""
    check_bits("bits", bits)
    check_group_size("group_size", group_size)
    check_axis(axis)
    check_levels("levels", levels, bits)
    exclude = outlier_mask(x, outlier_fraction, axis) if outlier_fraction else None
    x_n, scale, zero = normalize_groups(x, bits, group_size, axis, exclude)
    levels = levels.to(x.device)
    out = _ungrouped(levels[nearest_level(x_n, levels)] * scale + zero, x.shape, axis)
    if exclude is not None:
        out = torch.where(exclude, x.float(), out)
    return out.to(x.dtype)


def weighted_kmeans_1d(values: torch.Tensor, weights: torch.Tensor, k: int, *, init: torch.Tensor,
                       iterations: int = 50) -> torch.Tensor:
    """1-D Lloyd: k sorted centroids minimizing sum(w * (v - c)^2), from `init` (the uniform grid, so
    never worse than it); an empty cluster keeps its centroid."""
    values, weights = values.flatten().float(), weights.flatten().float()
    centroids = init.clone().float()
    for _ in range(iterations):
        assign = nearest_level(values, centroids)
        mass = torch.zeros(k).index_add_(0, assign, weights)
        moment = torch.zeros(k).index_add_(0, assign, weights * values)
        updated = torch.where(mass > 0, moment / mass.clamp(min=torch.finfo(torch.float32).tiny), centroids)
        updated, _ = updated.sort()
        if torch.allclose(updated, centroids, atol=1e-6, rtol=0):
            return updated
        centroids = updated
    return centroids


def weighted_error(values: torch.Tensor, weights: torch.Tensor, levels: torch.Tensor) -> float:
    values, weights = values.flatten().float(), weights.flatten().float()
    return float((weights * (values - levels[nearest_level(values, levels)]) ** 2).sum())


def normalized_with_weights(x: torch.Tensor, fisher: torch.Tensor, bits: int, group_size: int, axis: str,
                            outlier_fraction: float = 0.0):
    """(x_n, weights fisher * scale^2: the error in the activation's units); outliers get weight 0."""
    exclude = outlier_mask(x, outlier_fraction, axis) if outlier_fraction else None
    x_n, scale, _ = normalize_groups(x, bits, group_size, axis, exclude)
    weights = _grouped(fisher.float(), group_size, axis) * scale**2
    if exclude is not None:
        weights = weights.masked_fill(_grouped(exclude, group_size, axis), 0.0)
    return x_n, weights


def calibrate_levels(x: torch.Tensor, fisher: torch.Tensor, bits: int, group_size: int, axis: str,
                     iterations: int = 50, outlier_fraction: float = 0.0) -> torch.Tensor:
    """nuq levels for activations x [..., T, D] and their diagonal Fisher information (same shape)."""
    x_n, weights = normalized_with_weights(x, fisher, bits, group_size, axis, outlier_fraction)
    return weighted_kmeans_1d(x_n, weights, 2**bits, init=uniform_levels(bits), iterations=iterations)


def calibrate_tables(activations: list[dict], *, bits_list, group_size: int, sparse_outliers: float = 0.0,
                     progress=None) -> dict:
    """The levels file's "bits" table from each layer's {"k", "v", "k_fisher", "v_fisher"}, with each
    layer's weighted error relative to the uniform grid's (< 1 is better)."""
    tables = {}
    for bits in bits_list:
        entry = {"k": [], "v": [], "k_error_vs_uniform": [], "v_error_vs_uniform": []}
        layers = activations if progress is None else progress(activations, f"nuq{bits} k-means")
        for layer in layers:
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


def levels_file(tables: dict, *, model: str, num_layers: int, group_size: int, head_dim: int | None = None,
                pre_rope: bool = False, sparse_outliers: float = 0.0, calibration: dict | None = None,
                levels_rotations: str | None = None) -> dict:
    """The `kivi calibrate` file as a dict: the levels and the settings load_tables checks.
    levels_rotations: the digest of the calibrated rotations the levels were fitted after (None: unrotated)."""
    return dict(format=FORMAT, model=model, num_layers=num_layers, head_dim=head_dim, group_size=group_size,
                key_axis=KEY_AXIS, value_axis=VALUE_AXIS, pre_rope=pre_rope, sparse_outliers=sparse_outliers,
                levels_rotations=levels_rotations, calibration=calibration or {}, bits=tables)


def write_levels_file(path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def load_tables(path, *, bits: int, num_layers: int | None, group_size: int, pre_rope: bool = False,
                sparse_outliers: float = 0.0, model: str | None = None, head_dim: int | None = None,
                rotations: str | None = None) -> dict:
    """{"k": [levels per layer], "v": [...]} from a `kivi calibrate` file, checked against the model
    and settings that will use it (None or absent fields are not checked, except `rotations`: the
    digest of the calibrated rotations the cache applies to keys and values, None for none, which
    must be the basis the levels were fitted in)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--nuq {path}: cannot read a calibration file ({e})")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"--nuq {path}: not a `kivi calibrate` file (format {found!r}, want {FORMAT!r})")

    def field(name, kind):
        if name not in data:
            raise ValueError(f"--nuq {path}: the field {name!r} is missing; re-create the file with `kivi calibrate`")
        if not isinstance(data[name], kind) or isinstance(data[name], bool):
            raise ValueError(f"--nuq {path}: {name!r} must be {kind.__name__}, got {data[name]!r}")
        return data[name]

    for name, want in (("model", model), ("head_dim", head_dim)):
        if want is not None and data.get(name) is not None and data[name] != want:
            raise ValueError(f"--nuq {path}: calibrated for {name} {data[name]!r}, but this run uses {name} {want!r}; "
                             f"the levels hold for the model they were calibrated on: calibrate for this one "
                             f"(kivi calibrate --model ...)")
    if num_layers is not None and field("num_layers", int) != num_layers:
        raise ValueError(f"--nuq {path}: calibrated for {data['num_layers']} layers, the model has {num_layers}")
    if field("group_size", int) != group_size:
        raise ValueError(f"--nuq {path}: calibrated with group_size={data['group_size']}, "
                         f"but --group-size is {group_size}")
    for flag, name, want in ((data.get("pre_rope", False), "--pre-rope", pre_rope),
                             (data.get("sparse_outliers", 0.0), "--sparse-outliers", sparse_outliers)):
        if flag != want:
            raise ValueError(f"--nuq {path}: calibrated with {name} {flag}, but this run uses {name} {want}; "
                             f"calibrate with the same settings (kivi calibrate {name} ...)")
    _check_basis(path, data.get("levels_rotations"), rotations)
    by_bits = field("bits", dict)
    if str(bits) not in by_bits:
        raise ValueError(f"--nuq {path}: has levels for bits {sorted(by_bits)}, not {bits}")
    entry = by_bits[str(bits)]
    tables = {}
    for part in ("k", "v"):
        layers = entry.get(part) if isinstance(entry, dict) else None
        if not isinstance(layers, list) or (num_layers is not None and len(layers) != num_layers):
            raise ValueError(f"--nuq {path}: bits {bits} {part!r} must be a list of levels per layer"
                             + (f" ({num_layers} layers)" if num_layers is not None else ""))
        try:
            tables[part] = [torch.tensor(levels, dtype=torch.float32) for levels in layers]
        except (TypeError, ValueError) as e:
            raise ValueError(f"--nuq {path}: bits {bits} {part!r} levels must be lists of numbers ({e})")
        for i, levels in enumerate(tables[part]):
            if levels.dim() != 1 or not levels_ok(levels.tolist(), bits):
                raise ValueError(f"--nuq {path}: bits {bits} {part!r} layer {i}: the levels must be "
                                 f"{levels_rule(bits)}, got {layers[i]!r}")
    return tables


def _check_basis(path, stored: str | None, used: str | None) -> None:
    if stored == used:
        return
    if used is None:
        raise ValueError(f"--nuq {path}: its levels were fitted after the file's calibrated rotations (sha256 "
                         f"{stored}), but this cache does not apply them: add --rotate-keys calibrated --rotate-values "
                         f"calibrated --rotations {path}")
    if stored is None:
        raise ValueError(f"--nuq {path}: its levels were fitted unrotated, but this cache rotates keys and values "
                         f"with calibrated rotations (sha256 {used}): pass one `kivi calibrate` file (fitted with "
                         "its rotations, i.e. without --no-rotations) to both --nuq and --rotations")
    raise ValueError(f"--nuq {path}: its levels were fitted after calibrated rotations sha256 {stored}, but this "
                     f"cache applies sha256 {used}: pass the same `kivi calibrate` file to --nuq and --rotations")


def levels_basis(rotate_keys: str, rotate_values: str, rotations) -> str | None:
    """The `rotations` digest load_tables checks for a cache with these rotations: the calibrated ones'
    digest, or None; ValueError when only one of keys and values is calibrated (no file's levels fit)."""
    calibrated = (rotate_keys == "calibrated", rotate_values == "calibrated")
    if calibrated == (False, False):
        return None
    if calibrated != (True, True):
        raise ValueError("--nuq with calibrated rotations needs both --rotate-keys calibrated and --rotate-values "
                         f"calibrated (the levels are fitted in one basis for both), got --rotate-keys {rotate_keys} "
                         f"--rotate-values {rotate_values}")
    return rotations.digest


def load_kv_levels(path, *, k_bits: int, v_bits: int, num_layers: int | None, group_size: int,
                   pre_rope: bool = False, sparse_outliers: float = 0.0, model: str | None = None,
                   head_dim: int | None = None, rotations: str | None = None, layer_bits: tuple = ()) -> tuple[list, list]:
    """Per-layer key and value levels at k_bits / v_bits, or at each layer's widths in layer_bits."""
    settings = dict(num_layers=num_layers, group_size=group_size, pre_rope=pre_rope, sparse_outliers=sparse_outliers,
                    model=model, head_dim=head_dim, rotations=rotations)
    if not layer_bits:
        return load_tables(path, bits=k_bits, **settings)["k"], load_tables(path, bits=v_bits, **settings)["v"]
    tables = {b: load_tables(path, bits=b, **settings) for b in sorted({b for pair in layer_bits for b in pair})}
    return ([tables[k]["k"][i] for i, (k, _) in enumerate(layer_bits)],
            [tables[v]["v"][i] for i, (_, v) in enumerate(layer_bits)])


def config_levels(path, *, rotate_keys: str = "none", rotate_values: str = "none", rotations=None, **settings) -> dict:
    """KIVIConfig's key_levels / value_levels from a `kivi calibrate` file, for a cache with these
    rotations (CalibratedRotations or None; the levels must be fitted in their basis) and settings as
    load_kv_levels."""
    keys, values = load_kv_levels(path, rotations=levels_basis(rotate_keys, rotate_values, rotations), **settings)
    as_tuples = lambda tables: tuple(tuple(float(v) for v in levels.tolist()) for levels in tables)  # noqa: E731
    return dict(key_levels=as_tuples(keys), value_levels=as_tuples(values))
