"""Teacher-forced perplexity through the real KIVI cache (or the fp static cache), and the paper's
simulated "fake" configurations (KIVI Table 1: every token quantized, no residual window).

Cache methods feed each window in chunks of C tokens through the patched model, exactly as
decoding appends them. With C = 1 (the default) every prediction sees precisely the quantized
history and residual window that token-by-token decoding would. With C > 1 a chunk's queries see
the cache after the whole chunk was appended, so a key flush or a value leaving the window inside
the chunk is seen a few tokens early (slightly pessimistic); the first chunk is a prefill and
attends over exact keys/values, as in generation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kivi_models import make_cache
from kivi_ops import KIVIConfig, fake_quantize
from kivi_ops.config import check_bits, check_group_size
from kivi_ops.calibration.nuq import fake_quantize_nuq, uniform_levels
from kivi_ops.options.rope import apply_rope, model_rope_tables, undo_rope
from kivi_ops.options.rotation import check_rotation, rotate, rotation_matrix, unrotate

FAKE_ATTN = "kivi_fake"


# Fake-quantization axes: KIVI's two (groups of G tokens per channel, groups of G channels per
# token) and "head": per token, one group over the whole head (a scale and zero per token per head,
# as vLLM-style per-token int KV caches do).
FAKE_AXES = ("channel", "token", "head")
# "int": KIVI's asymmetric min/max integer grid; "fp8": float8 e4m3 with one scale per head
# (amax of that head over the window / 448), the bits and axes unused (8 bits, k_bits = v_bits = 8).
FAKE_FORMATS = ("int", "fp8")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BITS = 16  # an fp16 scale or zero


@dataclass(frozen=True)
class FakeQuantConfig:
    """Simulated quantization of all keys and values (no residual), as KIVI Table 1, and the
    baselines: per-token-head int (axis "head"), FP8 e4m3 with a per-head scale (format "fp8"),
    each optionally rotated (k_rotation / v_rotation, kivi_ops/options/rotation.py: x M is quantized and
    rotated back)."""

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    k_axis: str = "channel"
    v_axis: str = "token"
    k_rotation: str = "none"
    v_rotation: str = "none"
    rotation_seed: int = 0
    format: str = "int"

    def __post_init__(self):
        check_bits("k_bits", self.k_bits)
        check_bits("v_bits", self.v_bits)
        check_group_size("group_size", self.group_size)
        for name in ("k_axis", "v_axis"):
            if getattr(self, name) not in FAKE_AXES:
                raise ValueError(f"{name} must be one of {FAKE_AXES}, got {getattr(self, name)!r}")
        check_rotation("k_rotation", self.k_rotation)
        check_rotation("v_rotation", self.v_rotation)
        if self.format not in FAKE_FORMATS:
            raise ValueError(f"format must be one of {FAKE_FORMATS}, got {self.format!r}")
        if self.format == "fp8" and (self.k_bits, self.v_bits) != (8, 8):
            raise ValueError(f"format='fp8' stores 8 bits per element: k_bits and v_bits must be 8, "
                             f"got {self.k_bits} and {self.v_bits}")

    def to_dict(self) -> dict:
        return dict(k_bits=self.k_bits, v_bits=self.v_bits, group_size=self.group_size,
                    k_axis=self.k_axis, v_axis=self.v_axis, k_rotation=self.k_rotation,
                    v_rotation=self.v_rotation, rotation_seed=self.rotation_seed, format=self.format)

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per key/value element, K and V averaged, counting each group's fp16 scale
        and zero (fp8: one fp16 scale per head per window, counted as 0)."""
        if self.format == "fp8":
            return 8.0

        def one(bits: int, axis: str) -> float:
            group = {"channel": self.group_size, "token": min(self.group_size, head_dim), "head": head_dim}[axis]
            return bits + 2 * SCALE_BITS / group

        return (one(self.k_bits, self.k_axis) + one(self.v_bits, self.v_axis)) / 2


def fake_fp8_per_head(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] through float8 e4m3 with one scale per (row, head): amax over the window's
    tokens and channels / 448 (a constant head reconstructs exactly; zeros stay zeros)."""
    xf = x.float()
    scale = xf.abs().amax(dim=(-2, -1), keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _fake_int(x: torch.Tensor, bits: int, group_size: int, axis: str, levels=None, sparse: float = 0.0):
    """KIVI's fake quantization of x along axis ("head": G = head_dim along tokens' channels)."""
    if axis == "head":
        axis, group_size = "token", x.shape[-1]
    if levels is None:
        return fake_quantize(x.contiguous(), bits, group_size, axis)
    return fake_quantize_nuq(x, bits, group_size, axis, levels, sparse)


def _fake_quant_attention(module, query, key, value, attention_mask, **kwargs):
    spec: FakeQuantConfig = module.config.kivi_fake_quant
    nuq, sparse = module.config.kivi_fake_nuq, module.config.kivi_fake_sparse
    rope = module.config.kivi_fake_pre_rope  # (cos, sin) [1, 1, T, D] of positions 0..T-1, or None
    mk, mv = module.config.kivi_fake_rotation  # the rotation matrices (None: off)
    if rope is not None:  # KVQuant pre-RoPE: quantize the keys as they were before the rotation
        cos, sin = (t[:, :, : key.shape[2]].to(key.dtype) for t in rope)
        key = undo_rope(key, cos, sin)
    key, value = rotate(key, mk), rotate(value, mv)
    if spec.format == "fp8":
        key, value = fake_fp8_per_head(key), fake_fp8_per_head(value)
    elif nuq is None and not sparse:
        key = _fake_int(key, spec.k_bits, spec.group_size, spec.k_axis)
        value = _fake_int(value, spec.v_bits, spec.group_size, spec.v_axis)
    else:  # KVQuant: nuq levels (or KIVI's uniform grid) with dense-and-sparse outliers
        layer = module.layer_idx
        k_levels = nuq["k"][layer] if nuq else uniform_levels(spec.k_bits)
        v_levels = nuq["v"][layer] if nuq else uniform_levels(spec.v_bits)
        key = _fake_int(key, spec.k_bits, spec.group_size, spec.k_axis, k_levels, sparse)
        value = _fake_int(value, spec.v_bits, spec.group_size, spec.v_axis, v_levels, sparse)
    key, value = unrotate(key, mk), unrotate(value, mv)
    if rope is not None:
        key = apply_rope(key, cos, sin)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# The mask function is registered too: without it transformers would silently build no mask.
AttentionInterface.register(FAKE_ATTN, _fake_quant_attention)
AttentionMaskInterface.register(FAKE_ATTN, sdpa_mask)


def cache_bits_per_element(patched_model, method: str, kivi_config: Optional[KIVIConfig], tokens: int = 4096) -> float:
    """Stored bits per key/value element of one sequence of `tokens` in the model's full-attention
    layers, exact (KIVICache.nbytes on the meta device, fp16 scales and residual): codes, scales,
    zeros, the full-precision residual window and every option's store; 16.0 for the fp cache."""
    cache = make_cache(patched_model, method=method, batch_size=1, max_seq_len=tokens, kivi_config=kivi_config,
                       device="meta", dtype=torch.float16)
    return stored_bits_per_element(cache, tokens)


def stored_bits_per_element(cache, tokens: int) -> float:
    """cache_bits_per_element of a cache already sized for one sequence of `tokens` (fp16, e.g. on
    the meta device): bits stored per key/value element of its full-attention layers."""
    full = [layer for layer in cache.layers if not layer.is_sliding]
    elements = 2 * len(full) * cache.num_kv_heads * tokens * cache.head_dim
    return 8 * sum(layer.nbytes() for layer in full) / elements


@dataclass
class PerplexityResult:
    ppl: float
    tokens: int
    seconds: float

    def to_dict(self) -> dict:
        return dict(ppl=self.ppl, tokens=self.tokens, seconds=self.seconds)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


@torch.inference_mode()
def fake_quant_perplexity(plain_model, windows: torch.Tensor, spec: Optional[FakeQuantConfig], *,
                          batch_size: int = 8, desc: str = "ppl", nuq: Optional[dict] = None,
                          sparse_outliers: float = 0.0, pre_rope: bool = False) -> PerplexityResult:
    """One full forward per window with every key/value fake-quantized (spec=None: 16-bit).
    nuq: per-layer nuqX levels {"k": [...], "v": [...]} (kivi_ops/calibration/nuq.py) instead of the uniform grid.
    sparse_outliers: the fraction of each vector kept exact (kivi_ops/options/dense_sparse.py).
    pre_rope: quantize keys before RoPE and rotate after dequantization (kivi_ops/options/rope.py)."""
    if spec is not None and windows.shape[1] % spec.group_size:
        raise ValueError(f"--window must be a multiple of group_size={spec.group_size} for fake quantization")
    previous = plain_model.config._attn_implementation
    plain_model.config.kivi_fake_quant = spec
    plain_model.config.kivi_fake_nuq = nuq
    plain_model.config.kivi_fake_sparse = sparse_outliers
    # every fake window starts at position 0
    plain_model.config.kivi_fake_pre_rope = model_rope_tables(plain_model, windows.shape[1]) if pre_rope else None
    if spec is not None:
        D = getattr(plain_model.config, "head_dim", None) or (
            plain_model.config.hidden_size // plain_model.config.num_attention_heads)
        plain_model.config.kivi_fake_rotation = tuple(
            None if m is None else m.to(plain_model.device)
            for m in (rotation_matrix(spec.k_rotation, D, spec.rotation_seed),
                      rotation_matrix(spec.v_rotation, D, spec.rotation_seed)))
    plain_model.config._attn_implementation = FAKE_ATTN if spec is not None else "sdpa"
    start, nll, count = time.perf_counter(), 0.0, 0
    try:
        with tqdm(total=windows.numel() - len(windows), desc=desc, unit="tok", leave=False) as bar:
            for i in range(0, len(windows), batch_size):
                win = windows[i : i + batch_size].to(plain_model.device)
                logits = plain_model(input_ids=win, use_cache=False).logits[:, :-1]
                nll += float(_nll(logits, win[:, 1:]))
                count += win[:, 1:].numel()
                bar.update(win[:, 1:].numel())
    finally:
        plain_model.config._attn_implementation = previous
    return PerplexityResult(math.exp(nll / count), count, time.perf_counter() - start)


@torch.inference_mode()
def cache_perplexity(patched_model, windows: torch.Tensor, *, method: str, kivi_config: Optional[KIVIConfig] = None,
                     chunk: int = 1, batch_size: int = 8, desc: str = "ppl") -> PerplexityResult:
    """Teacher-forced perplexity with each window fed through a static cache, `chunk` tokens a step."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    W = windows.shape[1]
    device = patched_model.device
    start, nll, count = time.perf_counter(), 0.0, 0
    with tqdm(total=windows.numel() - len(windows), desc=desc, unit="tok", leave=False) as bar:
        for i in range(0, len(windows), batch_size):
            win = windows[i : i + batch_size].to(device)
            b = len(win)
            cache = make_cache(patched_model, method=method, batch_size=b, max_seq_len=W, kivi_config=kivi_config)
            for pos in range(0, W - 1, chunk):
                stop = min(pos + chunk, W - 1)  # feed tokens [pos, stop), predict tokens [pos+1, stop]
                positions = torch.arange(pos, stop, device=device).expand(b, -1)
                logits = patched_model(input_ids=win[:, pos:stop], position_ids=positions,
                                       past_key_values=cache, use_cache=True).logits
                nll += float(_nll(logits, win[:, pos + 1 : stop + 1]))
                count += b * (stop - pos)
                bar.update(b * (stop - pos))
    return PerplexityResult(math.exp(nll / count), count, time.perf_counter() - start)

