"""--preset NAME: a recommended KIVI cache per built-in model, read from its shipped `kivi calibrate
--bits-budget` file (in RESULTS_DIR). The CLI's --preset and `kivi eval table`'s preset rows both
resolve a preset here, so that they name the same cache."""

from __future__ import annotations

import json
from pathlib import Path

from kivi_models.loading import DEFAULT_MODEL, DEFAULT_NAME
from kivi_ops import KIVIConfig

from . import RESULTS_DIR

PRESETS = {"quality-2bit": "the model's shipped calibration at <= 3 bits per element (4K tokens, scales and the fp "
                           "window counted): calibrated rotations of keys and values and per-layer widths, with its "
                           "--group-size and --residual-length"}
# Per preset, per built-in model (--model), its shipped calibration file in RESULTS_DIR.
SHIPPED_CALIBRATION = {"quality-2bit": {DEFAULT_MODEL: "calibration_smollm2_bits3.json"}}
_MODEL_NAMES = {DEFAULT_MODEL: f"{DEFAULT_MODEL} ({DEFAULT_NAME})"}


def presets_for(model: str) -> list[str]:
    """The presets with a shipped calibration for --model `model`."""
    return [name for name in PRESETS if model in SHIPPED_CALIBRATION[name]]


def preset_calibration(preset: str, model: str) -> Path:
    """The shipped calibration file of `preset` for --model `model`; ValueError naming the preset and
    the models it is shipped for when there is none."""
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    name = SHIPPED_CALIBRATION[preset].get(model)
    if name is None:
        shipped = ", ".join(_MODEL_NAMES.get(m, m) for m in SHIPPED_CALIBRATION[preset])
        raise ValueError(f"--preset {preset}: no shipped calibration for --model {model} (shipped for --model "
                         f"{shipped}); calibrate it with `kivi calibrate --bits-budget 3 --group-size G "
                         "--residual-length R` and pass --layer-bits FILE --rotations FILE --rotate-keys calibrated "
                         "--rotate-values calibrated")
    return RESULTS_DIR / name


def calibration_identity(model: str) -> dict:
    """--model's identity as calibration files record it (calibrated_rotation.model_identity)."""
    from kivi_ops.calibration.rotations import model_identity

    from kivi_models.loading import model_identity as loaded_model_identity
    from kivi_models.loading import resolve_model_path

    hf_config = json.loads((resolve_model_path(model) / "config.json").read_text())
    return model_identity(hf_config, loaded_model_identity(model))


def _shipped_widths(preset: str, model: str) -> tuple:
    """(file, identity, widths, its layer_bits section) of `preset` for --model `model`, checked
    against the model's identity (ValueError naming the preset and the field)."""
    from kivi_ops.calibration.layer_bits import load_layer_bits

    path, identity = preset_calibration(preset, model), calibration_identity(model)
    widths, section = load_layer_bits(path, identity, flag=f"--preset {preset}")
    return path, identity, widths, section


def preset_settings(preset: str, model: str) -> dict:
    """The cache flags `preset` sets for --model `model`, as the CLI's argument names."""
    path, _, _, section = _shipped_widths(preset, model)
    return dict(group_size=section["group_size"], residual_length=section["residual_length"],
                rotate_keys="calibrated", rotate_values="calibrated", rotations=str(path), layer_bits=str(path))


def preset_config(preset: str, model: str) -> KIVIConfig:
    """The KIVIConfig `--preset preset --model model` builds (the other flags at their defaults)."""
    from kivi_ops.calibration.rotations import load_rotations

    path, identity, widths, section = _shipped_widths(preset, model)
    return KIVIConfig(group_size=section["group_size"], residual_length=section["residual_length"],
                      rotate_keys="calibrated", rotate_values="calibrated", layer_bits=widths,
                      rotations=load_rotations(path, identity, keys=True, flag=f"--preset {preset}"))
