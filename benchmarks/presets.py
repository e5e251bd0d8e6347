"""--preset NAME: a recommended KIVI cache per built-in model: flags and its shipped `kivi calibrate`
files (in RESULTS_DIR). The CLI's --preset and `kivi eval table`'s preset rows both
resolve a preset here, so that they name the same cache."""

from __future__ import annotations

import json
from pathlib import Path

from kivi_models.loading import DEFAULT_MODEL, DEFAULT_NAME, GEMMA3_MODEL
from kivi_ops import KIVIConfig

from . import RESULTS_DIR

PRESETS = {"quality-2bit": "the model's best shipped setting at <= 3 bits per element (4K tokens, scales and the fp "
                           "window counted), from its `kivi calibrate` file: on SmolLM2 calibrated rotations of keys "
                           "and values, nuq levels fitted in their basis, per-layer widths and 4 sink tokens; on "
                           "Gemma 3 KVQuant-2 (pre-RoPE keys, nuq2 levels, 0.5% sparse outliers, 1 sink token)"}
# Per preset, per built-in model (--model): the flags it sets, as the CLI's argument names; the
# file flags (FILE_FLAGS) name files in RESULTS_DIR.
SHIPPED = {"quality-2bit": {
    DEFAULT_MODEL: dict(group_size=64, residual_length=64, rotate_keys="calibrated", rotate_values="calibrated",
                        rotations="calibration_smollm2_bits3.json", layer_bits="calibration_smollm2_bits3.json",
                        nuq="calibration_smollm2_bits3.json", sink_tokens=4),
    GEMMA3_MODEL: dict(group_size=128, residual_length=128, pre_rope=True, sparse_outliers=0.005, sink_tokens=1,
                       nuq="nuq_levels_gemma3_prerope_sparse05_g128_w16.json"),
}}
FILE_FLAGS = ("rotations", "layer_bits", "nuq")
# Every flag some preset sets (the CLI refuses them given with --preset).
PRESET_FLAGS = ("k_bits", "v_bits", "rotation_seed",
                *dict.fromkeys(flag for models in SHIPPED.values() for settings in models.values() for flag in settings))
_MODEL_NAMES = {DEFAULT_MODEL: f"{DEFAULT_MODEL} ({DEFAULT_NAME})"}


def presets_for(model: str) -> list[str]:
    """The presets shipped for --model `model`."""
    return [name for name in PRESETS if model in SHIPPED[name]]


def preset_settings(preset: str, model: str) -> dict:
    """The cache flags `preset` sets for --model `model`, as the CLI's argument names (files as paths);
    ValueError naming the preset and the models it is shipped for when there is none."""
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    settings = SHIPPED[preset].get(model)
    if settings is None:
        shipped = ", ".join(_MODEL_NAMES.get(m, m) for m in SHIPPED[preset])
        raise ValueError(f"--preset {preset}: no shipped calibration for --model {model} (shipped for --model "
                         f"{shipped}); calibrate it with `kivi calibrate --bits-budget 3 --group-size G "
                         "--residual-length R` and pass --layer-bits FILE --rotations FILE --rotate-keys calibrated "
                         "--rotate-values calibrated")
    return {flag: str(RESULTS_DIR / value) if flag in FILE_FLAGS else value for flag, value in settings.items()}


def preset_files(preset: str, model: str) -> list[Path]:
    """The shipped files `preset` reads for --model `model`."""
    settings = preset_settings(preset, model)
    return [Path(p) for p in dict.fromkeys(settings[flag] for flag in FILE_FLAGS if flag in settings)]


def calibration_identity(model: str) -> dict:
    """--model's identity as calibration files record it (calibrated_rotation.model_identity)."""
    from kivi_ops.calibration.rotations import model_identity

    from kivi_models.loading import model_identity as loaded_model_identity
    from kivi_models.loading import resolve_model_path

    hf_config = json.loads((resolve_model_path(model) / "config.json").read_text())
    return model_identity(hf_config, loaded_model_identity(model))


def preset_config(preset: str, model: str) -> KIVIConfig:
    """The KIVIConfig `--preset preset --model model` builds (the other flags at their defaults)."""
    from kivi_ops.calibration.layer_bits import load_layer_bits
    from kivi_ops.calibration.nuq import config_levels
    from kivi_ops.calibration.rotations import load_rotations

    from kivi_models.loading import head_dim_of, resolve_model_path
    from kivi_models.loading import model_identity as loaded_model_identity

    settings, identity, flag = preset_settings(preset, model), calibration_identity(model), f"--preset {preset}"
    fields = {name: value for name, value in settings.items() if name not in FILE_FLAGS}
    if "rotations" in settings:
        fields["rotations"] = load_rotations(settings["rotations"], identity,
                                             keys=settings.get("rotate_keys") == "calibrated", flag=flag)
    if "layer_bits" in settings:
        fields["layer_bits"] = load_layer_bits(settings["layer_bits"], identity, flag=flag)[0]
    if "nuq" in settings:
        hf_config = json.loads((resolve_model_path(model) / "config.json").read_text())
        fields.update(config_levels(settings["nuq"], k_bits=2, v_bits=2, num_layers=hf_config["num_hidden_layers"],
                                    group_size=settings["group_size"], pre_rope=settings.get("pre_rope", False),
                                    sparse_outliers=settings.get("sparse_outliers", 0.0),
                                    model=loaded_model_identity(model), head_dim=head_dim_of(hf_config),
                                    rotate_keys=settings.get("rotate_keys", "none"),
                                    rotate_values=settings.get("rotate_values", "none"),
                                    rotations=fields.get("rotations"), layer_bits=fields.get("layer_bits", ())))
    return KIVIConfig(**fields)
