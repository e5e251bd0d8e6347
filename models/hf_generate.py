"""transformers' `generate()` with our cache: it asks `get_compiled_call` of a compileable cache's
model, which answers with the library's compiled step (docs/usage.md, "Hugging Face models")."""

from __future__ import annotations

import functools
from types import MethodType

import torch
from transformers import CompileConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from kivi_ops import StaticCacheBase

from .generate import compile_decode_step
from .parallel import local_kv_heads


def enable_compiled_generate(model) -> None:
    """Let `model.generate()` with our cache run compiled decode steps (on CPU too: it asks)."""
    model.create_masks_for_generate = _keep_2d_mask
    model.get_compiled_call = MethodType(_compiled_call, model)
    config = model.generation_config
    if config.compile_config is None:
        config.compile_config = CompileConfig(fullgraph=True, dynamic=False)
    config.compile_config._compile_all_devices = True


def generate_from_a_reset_cache(model, generate):
    """model.generate that empties a passed cache first: our caches keep no ids, so reuse would be stale."""

    @functools.wraps(generate)
    def call(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, StaticCacheBase):
            check_cache_fits(model, cache)
            if bool(cache.lengths().any()):  # a fresh cache needs no reset (it zeroes every buffer)
                cache.reset()
        return generate(*args, **kwargs)

    return call


def check_cache_fits(model, cache: StaticCacheBase) -> None:
    want = (model.config.num_hidden_layers, local_kv_heads(model), model.model.layers[0].self_attn.head_dim)
    have = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if have != want:
        raise ValueError(
            f"past_key_values was built for another model: {_layout(*have)}, but this model has {_layout(*want)}; "
            "build the cache with kivi_models.make_cache(model, ...)")


def check_cache_rows(cache: StaticCacheBase, rows: int) -> None:
    """Raise unless a model call over `rows` sequences fits the cache's batch_size (it cannot grow)."""
    if rows != cache.batch_size:
        raise ValueError(
            f"past_key_values holds batch_size={cache.batch_size} rows but the model runs {rows}: generate() runs "
            "one row per prompt times num_beams (beam search) or num_return_sequences (sampling); build the cache "
            f"with make_cache(model, ..., batch_size={rows})")


def _layout(layers: int, heads: int, head_dim: int) -> str:
    return f"{layers} layers of {heads} KV heads x head_dim {head_dim}"


def _keep_2d_mask(*, attention_mask=None, **kwargs):
    return attention_mask


def _compiled_call(model, compile_config=None):
    """get_compiled_call's contract: a model call, compiled where it is a decode step over our cache."""
    steps = model.__dict__.setdefault("_kivi_compiled_steps", {})  # per device: a model moved later compiles anew
    if model.device not in steps:
        steps[model.device] = compile_decode_step(model.device)
    step = steps[model.device]

    def call(input_ids=None, past_key_values=None, position_ids=None, cache_position=None, **kwargs):
        if not _is_decode_step(input_ids, past_key_values, kwargs):
            return model(input_ids=input_ids, past_key_values=past_key_values, position_ids=position_ids,
                         cache_position=cache_position, **kwargs)
        B = input_ids.shape[0]
        if position_ids is None:  # the model's own default: the cache positions
            position_ids = cache_position[None, :].expand(B, -1)
        logits = step(model, past_key_values, input_ids[:, 0], position_ids[:, 0].to(torch.int64))
        return CausalLMOutputWithPast(logits=logits[:, None, :], past_key_values=past_key_values)

    return call


# A call with any of these set runs the model's own forward (the compiled step returns logits only).
_UNSUPPORTED = ("inputs_embeds", "output_attentions", "output_hidden_states", "labels")


def _is_decode_step(input_ids, cache, kwargs) -> bool:
    asked = [kwargs.get(name) for name in _UNSUPPORTED]
    return (isinstance(cache, StaticCacheBase) and input_ids is not None and input_ids.dim() == 2
            and input_ids.shape[1] == 1 and all(value is None or value is False for value in asked)
            and kwargs.get("logits_to_keep", 1) in (0, 1))
