"""transformers' `generate()` with our cache: compiled decode steps, with no extra call.

Our caches say they can be compiled (`is_compileable`). transformers then runs every decode step
of `generate()` through `model.get_compiled_call(...)`; a patched model answers with the
library's own compiled step (`compile_decode_step`): on CPU one decoder layer compiled once for
all layers (seconds to compile, not minutes), on CUDA the whole step under CUDA graphs. Prompts
run eagerly, as transformers does anyway. One graph serves every decode step (static shapes: one
token per row, positions and lengths as tensors).

Two things make that safe:
- transformers builds a 4-D mask for compileable caches; the KIVI attention masks by per-row
  lengths and reads the 2-D mask only at the prompt, to find a left-padded batch's pads. The
  patched model keeps the 2-D mask (`create_masks_for_generate`).
- transformers compiles on CPU only when asked (`compile_config._compile_all_devices`), so a
  patched model's generation config asks.

What the caller passes is checked before transformers runs (`check_cache_fits`, `check_cache_rows`):
a cache built for another model, or with fewer or more rows than generate() runs (prompts x
`num_beams`, or x `num_return_sequences` when sampling), is refused naming both sides. Beam search
works: transformers reorders the cache's rows after each step (`StaticCacheBase.reorder_cache`).

The first decode step compiles (about 10 s on the 2-core CPU for the embedded model); later
calls with the same shapes reuse the graph. `model.generate(..., disable_compile=True)` opts out
and runs the eager step; on CPU its cache ops then run kernels compiled per op on their first
call (kivi_ops/kernels/cpu_compiled.py; `KIVI_CPU_KERNELS=reference` for the reference).
"""

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
    """Let `model.generate()` with our cache run compiled decode steps (see the module doc)."""
    model.create_masks_for_generate = _keep_2d_mask
    model.get_compiled_call = MethodType(_compiled_call, model)
    config = model.generation_config
    if config.compile_config is None:
        config.compile_config = CompileConfig(fullgraph=True, dynamic=False)
    config.compile_config._compile_all_devices = True


def generate_from_a_reset_cache(model, generate):
    """model.generate, checking a library cache passed as past_key_values against the model and
    emptying it before generation starts.

    transformers' generate() takes the ids as the whole sequence and a non-empty cache as holding
    its first get_seq_length() tokens: it feeds only the ids past them. Our caches keep no token
    ids to check that against, so a cache reused for a new prompt would silently continue stale
    state (a longer prompt: the old tokens plus the new prompt's tail) or fail cryptically (a
    shorter one). Resetting is right in both cases: the ids hold the whole sequence, so a
    continuation reruns its prefix and gets the same text. (transformers 5.23's generate() takes
    no cache_position, so there is no call that continues a cache without its prefix.)"""

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
    """Raise unless the cache has one layer per decoder layer, with the model's KV heads (this
    rank's, under tensor parallelism) and head_dim. Without this a cache of another model fails
    deep inside a layer (an IndexError for a missing layer)."""
    want = (model.config.num_hidden_layers, local_kv_heads(model), model.model.layers[0].self_attn.head_dim)
    have = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if have != want:
        raise ValueError(
            f"past_key_values was built for another model: {_layout(*have)}, but this model has {_layout(*want)}; "
            "build the cache with kivi_models.make_cache(model, ...)")


def check_cache_rows(cache: StaticCacheBase, rows: int) -> None:
    """Raise unless a model call over `rows` sequences fits the cache's batch_size (a static cache
    cannot grow). generate() runs prompts x num_beams rows in beam search, prompts x
    num_return_sequences when sampling."""
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
    """The decode-step callable transformers' generate() uses (its get_compiled_call contract):
    a model call, compiled where it is a decode step over our cache, the model's own otherwise."""
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


# Arguments of a model call that the compiled step does not produce or take (it returns logits
# and the cache only); a call with any of them set runs the model's own forward.
_UNSUPPORTED = ("inputs_embeds", "output_attentions", "output_hidden_states", "labels")


def _is_decode_step(input_ids, cache, kwargs) -> bool:
    asked = [kwargs.get(name) for name in _UNSUPPORTED]
    return (isinstance(cache, StaticCacheBase) and input_ids is not None and input_ids.dim() == 2
            and input_ids.shape[1] == 1 and all(value is None or value is False for value in asked)
            and kwargs.get("logits_to_keep", 1) in (0, 1))
