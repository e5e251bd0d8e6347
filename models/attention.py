"""KIVI attention for Hugging Face Llama-family models, swapped in without forking modeling code.
What a call does comes down as one `kivi_ops.Step` (`kivi_step`), or a pre-hook derives it."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kivi_ops import CacheLayer, StaticCacheBase, Step

from .hf_generate import check_cache_rows, enable_compiled_generate, generate_from_a_reset_cache
from .windows import attention_window

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
_SOFTCAP_WHY = ("attention-logit soft-capping (attn_logit_softcapping), which the fused KIVI attention does not "
                "implement")
UNSUPPORTED_WHY = {
    "gemma2": _SOFTCAP_WHY,
    "gemma3": "Gemma 3's multimodal wrapper (Gemma3ForConditionalGeneration); load the text model "
              "(Gemma3ForCausalLM, model_type 'gemma3_text', as transformers loads a Gemma 3 GGUF file)",
}
ATTN_IMPLEMENTATION = "kivi"

# No mask function: transformers builds no masks (the cache layers mask by per-row lengths).
AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)


class KIVIAttention(nn.Module):
    """The family's own projections, RoPE, the cache layer and o_proj; families differ only in `_project`."""

    def __init__(self, original: nn.Module, config):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_norm", "k_norm"):
            setattr(self, name, getattr(original, name, None))
        self.o_proj = original.o_proj
        self.layer_idx = original.layer_idx
        self.head_dim = original.head_dim
        self.scaling = original.scaling  # Gemma 3: query_pre_attn_scalar ** -0.5
        self.sliding_window = attention_window(original, config)  # None: full attention
        # Phi-3's fused qkv split points (no tensor parallelism for it).
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.apply_rotary_pos_emb = sys.modules[type(original).__module__].apply_rotary_pos_emb

    def _project(self, hidden_states):
        """q, k, v [B, heads, n, head_dim]; head counts from the outputs (a TP rank has its share)."""
        B, n, _ = hidden_states.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        q, k, v = (t.view(B, n, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:  # Qwen3, Gemma 3: RMS norm over each head's channels, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                kivi_step: Step = Step(), **kwargs):
        # The library's loop passes this layer's cache layer, so one compiled layer serves every layer.
        cache = past_key_values.layers[self.layer_idx] if isinstance(past_key_values, Cache) else past_key_values
        if not isinstance(cache, CacheLayer):
            raise ValueError(
                "a KIVI-patched model needs past_key_values=kivi_models.make_cache(...) (a KIVICache or FPCache); "
                f"got {type(past_key_values).__name__}"
            )
        if getattr(cache, "window", None) != self.sliding_window:
            raise ValueError(
                f"layer {self.layer_idx} attends over {_window_text(self.sliding_window)} but its cache layer is a "
                f"{type(cache).__name__} over {_window_text(getattr(cache, 'window', None))}; build the cache with "
                "kivi_models.make_cache(model, ...), which gives each layer the kind its attention needs")
        step = kivi_step
        B, n, _ = hidden_states.shape
        q, k, v = self._project(hidden_states)
        cos, sin = position_embeddings
        q, k_rotated = self.apply_rotary_pos_emb(q, k, cos, sin)
        if step.order is not None:
            # A left-padded prompt batch: real tokens move to the front, so pads never enter the cache.
            q, k, k_rotated, v = (_gather_tokens(t, step.order) for t in (q, k, k_rotated, v))
        cache.append((k if cache.pre_rope else k_rotated).contiguous(), v.contiguous(), step)
        if step.exact is not None:
            # Exports: one graph for prompt and decode, both paths run; torch.cond miscompiled (torch 2.13).
            out = torch.where(step.exact, self._exact_attention(q, k_rotated, v),
                              cache.attend(q.contiguous(), step, self.scaling))
        elif step.prefill:
            out = self._exact_attention(q, k_rotated, v)
        else:
            out = cache.attend(q.contiguous(), step, self.scaling)
        if step.order is not None:
            out = _gather_tokens(out, step.order.argsort(dim=1))  # the inverse permutation
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1)), None

    def _exact_attention(self, q, k, v):
        # Right padding: the causal mask hides pads. No branch on the length: exports keep it dynamic.
        if self.sliding_window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
        i = torch.arange(q.shape[2], device=q.device)
        offset = i[:, None] - i[None, :]
        mask = (offset >= 0) & (offset < self.sliding_window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)


def _window_text(window) -> str:
    return "all tokens (full attention)" if window is None else f"a sliding window of {window} tokens"


def _gather_tokens(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def step_of_call(module, args, kwargs):
    """The Step of a call that brings none: a prompt on an empty cache, ordered by the left-padded mask."""
    cache = kwargs.get("past_key_values")
    if "kivi_step" in kwargs or not isinstance(cache, StaticCacheBase):
        return None
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    shape = tokens.shape if tokens is not None else (args[0].shape if args else None)
    n = shape[1] if shape is not None else 1
    if shape is not None:
        check_cache_rows(cache, shape[0])
    fresh = cache.get_seq_length() == 0
    order = counts = None
    mask = kwargs.get("attention_mask")
    if fresh and isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 0).any()):
        real = mask.bool()
        if bool((real[:, 1:] < real[:, :-1]).any()):  # a real token after a pad: not left padding
            raise ValueError("attention_mask must be left padding (pads before each row's tokens) or right "
                             "padding through kivi_models.generate; got a mask with pads after real tokens")
        order = (~real).to(torch.int8).argsort(dim=1, stable=True)  # real tokens first, in order
        counts = real.sum(dim=1)
    return args, dict(kwargs, kivi_step=Step(counts=counts, prefill=fresh and n > 1, order=order))


def patch_model(model: nn.Module) -> nn.Module:
    config = model.config
    if config.model_type in UNSUPPORTED_WHY:
        raise ValueError(f"model_type {config.model_type!r} is not supported by the KIVI attention: "
                         f"{UNSUPPORTED_WHY[config.model_type]}. Supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping}: {_SOFTCAP_WHY}; "
                         "set it to None to run without soft-capping")
    decoder = model.model
    if getattr(decoder, "_kivi_patched", False):
        return model
    for layer in decoder.layers:
        layer.self_attn = KIVIAttention(layer.self_attn, config)
    config._attn_implementation = ATTN_IMPLEMENTATION
    decoder.register_forward_pre_hook(step_of_call, with_kwargs=True)
    enable_compiled_generate(model)
    model.generate = generate_from_a_reset_cache(model, model.generate)
    decoder._kivi_patched = True
    return model
