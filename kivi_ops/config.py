"""KIVI configuration: bit widths, group size and residual window, validated at construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

from .options.rotation import CACHE_ROTATIONS, CalibratedRotations, check_rotation
from .options.schedule import POLICIES, key_flush_unit, policy_id, residual_slots

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_AXES = ("channel", "token")
# Triton block shapes must be powers of two.
SUPPORTED_GROUP_SIZES = (4, 8, 16, 32, 64, 128, 256)
# KVQuant keeps 1 sink token, StreamingLLM 4; every attention call scans the pool, so it is bounded.
MAX_SINK_TOKENS = 64


def check_bits(name: str, bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_group_size(name: str, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{name} must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}")


def check_word_groups(name: str, bits: int, group_size: int) -> None:
    """A value group must hold whole packed words (3-bit words hold 8 codes)."""
    per = 8 if bits == 3 else 8 // bits
    if group_size % per:
        raise ValueError(f"{name}={bits} packs {per} codes per word (8 codes per 3 bytes), so group_size must be "
                         f"a multiple of {per} (one of {tuple(g for g in SUPPORTED_GROUP_SIZES if g % per == 0)}), "
                         f"got group_size={group_size}")


# Calibrated levels are means of values in [0, 2^B - 1], up to float rounding.
LEVEL_RANGE_SLACK = 1e-3


def levels_ok(levels, bits: int) -> bool:
    """2^bits finite, strictly increasing levels within [0, 2^bits - 1] (the range a group maps to)."""
    top = 2**bits - 1
    return (len(levels) == 2**bits and all(math.isfinite(v) for v in levels)
            and all(b > a for a, b in zip(levels, levels[1:]))
            and -LEVEL_RANGE_SLACK <= levels[0] and levels[-1] <= top + LEVEL_RANGE_SLACK)


def levels_rule(bits: int) -> str:
    return f"{2**bits} finite floats in ascending order, strictly increasing, within [0, {2**bits - 1}]"


def _check_level_tables(name: str, tables, bits) -> None:
    """bits: one width for every layer, or a list of them, one per layer (layer_bits)."""
    if not isinstance(tables, tuple):
        raise ValueError(f"{name} must be a tuple of per-layer level tuples, got {type(tables).__name__}")
    for i, levels in enumerate(tables):
        layer = bits if isinstance(bits, int) else bits[i] if i < len(bits) else None
        if layer is None:
            raise ValueError(f"{name} has {len(tables)} layers, layer_bits {len(bits)}: give one entry per layer")
        if not (isinstance(levels, tuple) and all(isinstance(v, float) for v in levels) and levels_ok(levels, layer)):
            raise ValueError(f"{name}[{i}] must be {levels_rule(layer)} (for {layer}-bit codes), got {levels!r}")


def _check_layer_bits(layer_bits, group_size: int) -> None:
    if not isinstance(layer_bits, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in layer_bits):
        raise ValueError(f"layer_bits must be a tuple of (k_bits, v_bits) pairs, one per layer (or () for "
                         f"k_bits / v_bits everywhere), got {layer_bits!r}")
    for i, (k, v) in enumerate(layer_bits):
        for part, bits in (("k_bits", k), ("v_bits", v)):
            check_bits(f"layer_bits[{i}] {part}", bits)
            check_word_groups(f"layer_bits[{i}] {part}", bits, group_size)


def check_axis(axis: str) -> None:
    if axis not in SUPPORTED_AXES:
        raise ValueError(f"axis must be one of {SUPPORTED_AXES}, got {axis!r}")


@dataclass(frozen=True)
class KIVIConfig:
    """How the KV cache is quantized (every option: docs/cache.md; off, the default, is exactly KIVI).

    k_bits / v_bits: 2, 3, 4 or 8. group_size (G): keys per channel in G-token groups, values per token
    in min(G, head_dim)-channel groups. residual_length (R): tokens kept exact; a multiple of G under
    flush_policy "kivi" (Algorithm 1), any positive int under "ott". sink_tokens, outlier_*: the exact
    token pool. pre_rope, sparse_outliers, key_levels / value_levels: KVQuant. rotate_*, rotation_seed,
    rotations: rotations of the head dimension. layer_bits: per-layer (k_bits, v_bits) (KVTuner).
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    sink_tokens: int = 0
    outlier_tokens: int = 0
    outlier_spill: int = 32
    outlier_skip_layers: int = 2
    pre_rope: bool = False
    sparse_outliers: float = 0.0
    key_levels: tuple = ()
    value_levels: tuple = ()
    flush_policy: str = "kivi"
    rotate_keys: str = "none"
    rotate_values: str = "none"
    rotation_seed: int = 0
    rotations: Optional[CalibratedRotations] = None
    layer_bits: tuple = ()

    def __post_init__(self) -> None:
        check_bits("k_bits", self.k_bits)
        check_bits("v_bits", self.v_bits)
        check_group_size("group_size", self.group_size)
        for name in ("k_bits", "v_bits"):
            check_word_groups(name, getattr(self, name), self.group_size)
        if self.flush_policy not in POLICIES:
            raise ValueError(f"flush_policy must be one of {POLICIES}, got {self.flush_policy!r}")
        r = self.residual_length
        if self.flush_policy == "ott":
            if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
                raise ValueError(f"residual_length must be a positive int (flush_policy='ott': any R, "
                                 f"independent of group_size), got {r!r}")
        elif isinstance(r, bool) or not isinstance(r, int) or r <= 0 or r % self.group_size:
            raise ValueError(
                f"residual_length must be a positive multiple of group_size={self.group_size} "
                f"(e.g. {self.group_size}, {4 * self.group_size}; or flush_policy='ott', where R and G "
                f"are independent), got {r!r}"
            )
        for name in ("sink_tokens", "outlier_tokens", "outlier_spill", "outlier_skip_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if self.sink_tokens > MAX_SINK_TOKENS:
            raise ValueError(f"sink_tokens must be at most {MAX_SINK_TOKENS} (the first tokens kept exact), "
                             f"got {self.sink_tokens}")
        unit = self.key_flush_unit
        if self.outlier_tokens > unit:
            name = "group_size" if self.flush_policy == "ott" else "residual_length"
            raise ValueError(
                f"outlier_tokens must be at most {name}={unit} (the tokens one quantization step "
                f"considers under flush_policy={self.flush_policy!r}), got {self.outlier_tokens}"
            )

        if not isinstance(self.pre_rope, bool):
            raise ValueError(f"pre_rope must be a bool, got {self.pre_rope!r}")
        f = self.sparse_outliers
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 0.5:
            raise ValueError(f"sparse_outliers must be a fraction in [0, 0.5), e.g. 0.01, got {f!r}")
        _check_layer_bits(self.layer_bits, self.group_size)
        for name, part, bits in (("key_levels", 0, self.k_bits), ("value_levels", 1, self.v_bits)):
            _check_level_tables(name, getattr(self, name), [p[part] for p in self.layer_bits] or bits)
        if bool(self.key_levels) != bool(self.value_levels):
            raise ValueError("key_levels and value_levels must be given together (nuq levels for keys and values)")
        if self.flush_policy == "ott" and self.sparse_outliers:
            raise ValueError("sparse_outliers is not supported with flush_policy='ott' (its key store is laid "
                             "out per R-token window of the kivi policy); use flush_policy='kivi'")
        check_rotation("rotate_keys", self.rotate_keys, CACHE_ROTATIONS)
        check_rotation("rotate_values", self.rotate_values, CACHE_ROTATIONS)
        calibrated = "calibrated" in (self.rotate_keys, self.rotate_values)
        if calibrated and not isinstance(self.rotations, CalibratedRotations):
            raise ValueError(f"rotate_keys/rotate_values='calibrated' needs rotations, a calibration file's matrices "
                             f"(kivi_ops.calibration.rotations.load_rotations; CLI: --rotations PATH), got {self.rotations!r}")
        if not calibrated and self.rotations is not None:
            raise ValueError("rotations are used only with rotate_keys or rotate_values='calibrated', got "
                             f"rotate_keys={self.rotate_keys!r}, rotate_values={self.rotate_values!r}")
        if isinstance(self.rotation_seed, bool) or not isinstance(self.rotation_seed, int):
            raise ValueError(f"rotation_seed must be an int, got {self.rotation_seed!r}")
        if self.pre_rope and self.rotate_keys != "none":
            raise ValueError(f"rotate_keys={self.rotate_keys!r} is not supported with pre_rope=True: the attention "
                             "op applies RoPE to the dequantized keys, which does not commute with the rotation; "
                             "use rotate_keys='none' with pre_rope (rotate_values works with it)")

    def for_layer(self, layer_idx: int) -> "KIVIConfig":
        if not self.layer_bits:
            return self
        if not 0 <= layer_idx < len(self.layer_bits):
            raise ValueError(f"layer_bits holds {len(self.layer_bits)} layers, no layer {layer_idx}")
        k, v = self.layer_bits[layer_idx]
        levels = {}
        if self.has_nuq:  # the layer reads only its own entry, which must be at its widths
            n = len(self.key_levels)
            levels = dict(key_levels=(self.key_levels[layer_idx],) * n, value_levels=(self.value_levels[layer_idx],) * n)
        return replace(self, k_bits=k, v_bits=v, layer_bits=(), **levels)

    def check_num_layers(self, num_layers: int) -> None:
        if self.has_nuq and (len(self.key_levels) != num_layers or len(self.value_levels) != num_layers):
            raise ValueError(f"key_levels/value_levels must have one entry per layer ({num_layers}), "
                             f"got {len(self.key_levels)} and {len(self.value_levels)}")
        if self.layer_bits and len(self.layer_bits) != num_layers:
            raise ValueError(f"layer_bits must have one (k_bits, v_bits) pair per layer ({num_layers}), "
                             f"got {len(self.layer_bits)}")

    @property
    def policy_id(self) -> int:
        return policy_id(self.flush_policy)

    @property
    def key_flush_unit(self) -> int:
        return key_flush_unit(self.policy_id, self.residual_length, self.group_size)

    def residual_slots(self) -> int:
        """Exact residual rows per head (before the max_seq_len cap): R under 'kivi', R + G - 1 under 'ott'."""
        return residual_slots(self.policy_id, self.residual_length, self.group_size)

    def layer_outlier_tokens(self, layer_idx: int) -> int:
        return 0 if layer_idx < self.outlier_skip_layers else self.outlier_tokens

    def layer_pool_size(self, layer_idx: int) -> int:
        n = self.layer_outlier_tokens(layer_idx)
        return self.sink_tokens + (n + self.outlier_spill if n else 0)

    def sparse_counts(self, head_dim: int) -> tuple[int, int]:
        """(exact entries per key channel per R-token window, per value token), at least 1 each when on."""
        if not self.sparse_outliers:
            return 0, 0
        return (max(1, round(self.sparse_outliers * self.residual_length)),
                max(1, round(self.sparse_outliers * head_dim)))

    @property
    def has_nuq(self) -> bool:
        return bool(self.key_levels)

    @property
    def has_pool(self) -> bool:
        return self.sink_tokens > 0 or self.outlier_tokens > 0

    def value_group_size(self, head_dim: int) -> int:
        return min(self.group_size, head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim <= 0 or head_dim % self.value_group_size(head_dim) or head_dim % 8:
            raise ValueError(
                f"head_dim must be a positive multiple of 8 and of group_size={self.group_size} "
                f"(or smaller than it and a multiple of 8), got {head_dim}"
            )

    def to_dict(self) -> dict:
        """The fields as JSON values; calibrated rotations as their file and digest."""
        return dict(asdict(self), rotations=self.rotations.record() if self.rotations is not None else None,
                    layer_bits=[list(p) for p in self.layer_bits])

    def to_record(self, nuq_source=None) -> dict:
        """to_dict with the nuq levels named by their source instead of listed."""
        record = self.to_dict()
        del record["key_levels"], record["value_levels"]
        return dict(record, nuq=str(nuq_source) if nuq_source is not None else None)
