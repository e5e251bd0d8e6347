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
from kivi_ops.config import check_axis, check_bits, check_group_size
from kivi_ops.nuq import fake_quantize_nuq, uniform_levels
from kivi_ops.rope import apply_rope, model_rope_tables, undo_rope

FAKE_ATTN = "kivi_fake"


@dataclass(frozen=True)
class FakeQuantConfig:
    """Simulated quantization of all keys and values (no residual), as KIVI Table 1."""

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    k_axis: str = "channel"
    v_axis: str = "token"

    def __post_init__(self):
        check_bits("k_bits", self.k_bits)
        check_bits("v_bits", self.v_bits)
        check_group_size("group_size", self.group_size)
        check_axis(self.k_axis)
        check_axis(self.v_axis)

    def to_dict(self) -> dict:
        return dict(k_bits=self.k_bits, v_bits=self.v_bits, group_size=self.group_size,
                    k_axis=self.k_axis, v_axis=self.v_axis)


def _fake_quant_attention(module, query, key, value, attention_mask, **kwargs):
    spec: FakeQuantConfig = module.config.kivi_fake_quant
    nuq, sparse = module.config.kivi_fake_nuq, module.config.kivi_fake_sparse
    rope = module.config.kivi_fake_pre_rope  # (cos, sin) [1, 1, T, D] of positions 0..T-1, or None
    if rope is not None:  # KVQuant pre-RoPE: quantize the keys as they were before the rotation
        cos, sin = (t[:, :, : key.shape[2]].to(key.dtype) for t in rope)
        key = undo_rope(key, cos, sin)
    if nuq is None and not sparse:
        key = fake_quantize(key.contiguous(), spec.k_bits, spec.group_size, spec.k_axis)
        value = fake_quantize(value.contiguous(), spec.v_bits, spec.group_size, spec.v_axis)
    else:  # KVQuant: nuq levels (or KIVI's uniform grid) with dense-and-sparse outliers
        layer = module.layer_idx
        k_levels = nuq["k"][layer] if nuq else uniform_levels(spec.k_bits)
        v_levels = nuq["v"][layer] if nuq else uniform_levels(spec.v_bits)
        key = fake_quantize_nuq(key, spec.k_bits, spec.group_size, spec.k_axis, k_levels, sparse)
        value = fake_quantize_nuq(value, spec.v_bits, spec.group_size, spec.v_axis, v_levels, sparse)
    if rope is not None:
        key = apply_rope(key, cos, sin)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# The mask function is registered too: without it transformers would silently build no mask.
AttentionInterface.register(FAKE_ATTN, _fake_quant_attention)
AttentionMaskInterface.register(FAKE_ATTN, sdpa_mask)


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
    nuq: per-layer nuqX levels {"k": [...], "v": [...]} (kivi_ops/nuq.py) instead of the uniform grid.
    sparse_outliers: the fraction of each vector kept exact (kivi_ops/dense_sparse.py).
    pre_rope: quantize keys before RoPE and rotate after dequantization (kivi_ops/rope.py)."""
    if spec is not None and windows.shape[1] % spec.group_size:
        raise ValueError(f"--window must be a multiple of group_size={spec.group_size} for fake quantization")
    previous = plain_model.config._attn_implementation
    plain_model.config.kivi_fake_quant = spec
    plain_model.config.kivi_fake_nuq = nuq
    plain_model.config.kivi_fake_sparse = sparse_outliers
    # every fake window starts at position 0
    plain_model.config.kivi_fake_pre_rope = model_rope_tables(plain_model, windows.shape[1]) if pre_rope else None
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

