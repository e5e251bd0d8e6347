"""`--additional-config '{"kivi": {...}}'`: the KIVI settings of a vLLM engine, checked once, with
messages that name what is refused. None when the key is absent: vLLM runs unchanged."""

from __future__ import annotations

from typing import Optional

import torch

from kivi_ops import KIVIConfig
from kivi_ops.paged_layout import check_page_size

KEY = "kivi"
# The paged KIVI cache's settings (kivi_ops/cache/paged.py refuses the static cache's extras).
CACHE_KEYS = ("k_bits", "v_bits", "group_size", "residual_length")
# Prefix caching (prefix_tails.py): the boundary of sharing, and the host memory of the window copies.
PREFIX_KEYS = ("prefix_chunk", "prefix_cache_mib")
ALLOWED = CACHE_KEYS + PREFIX_KEYS
BITS = (2, 4)
DEFAULT_PREFIX_CHUNK = 64  # rounded up to a multiple of --block-size
DEFAULT_PREFIX_CACHE_MIB = 512


def kivi_options(vllm_config) -> Optional[KIVIConfig]:
    """The KIVIConfig of vllm_config's additional_config["kivi"], or None."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if KEY not in extra:
        return None
    raw = extra[KEY]
    if not isinstance(raw, dict):
        raise ValueError(f'--additional-config "kivi" must be an object such as {{"k_bits": 2, "v_bits": 2, '
                         f'"group_size": 32, "residual_length": 128}}, got {raw!r}')
    unknown = sorted(set(raw) - set(ALLOWED))
    if unknown:
        raise ValueError(f'--additional-config "kivi": unknown or unsupported keys {unknown}; allowed: {list(ALLOWED)}')
    for name in ("k_bits", "v_bits"):
        if name in raw and raw[name] not in BITS:
            raise ValueError(f'--additional-config "kivi": {name} must be one of {BITS} (KIVI-2, KIVI-4), '
                             f"got {raw[name]!r}")
    for name in PREFIX_KEYS:
        if name in raw and (isinstance(raw[name], bool) or not isinstance(raw[name], int) or raw[name] <= 0):
            raise ValueError(f'--additional-config "kivi": {name} must be a positive int, got {raw[name]!r}')
    try:
        return KIVIConfig(**{k: v for k, v in raw.items() if k in CACHE_KEYS})
    except ValueError as e:
        raise ValueError(f'--additional-config "kivi": {e}') from None


def check_engine(vllm_config, config: KIVIConfig) -> list[str]:
    """Refuse what the KIVI backend cannot serve (ValueError naming it). Returns the notes of what
    it changes (prefix caching is turned off under tensor parallelism)."""
    cache = vllm_config.cache_config
    if cache.cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {cache.cache_dtype} cannot be combined with the KIVI cache "
                         '(--additional-config "kivi"): use --kv-cache-dtype auto, KIVI sets the cache format')
    model = vllm_config.model_config
    if model is not None and getattr(model, "use_mla", False):
        raise ValueError("the KIVI cache does not support MLA models (latent KV cache)")
    if cache.block_size is not None:
        try:
            check_page_size(cache.block_size, config.group_size)
        except ValueError:
            raise ValueError(f"--block-size {cache.block_size} must be a multiple of the KIVI group_size="
                             f"{config.group_size} (a block holds whole key groups)") from None
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("the KIVI cache does not support --pipeline-parallel-size > 1 (not tested)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ValueError("the KIVI cache does not support KV connectors (--kv-transfer-config): a request they "
                         "resume mid-sequence would have no full-precision window")
    if vllm_config.speculative_config is not None:
        raise ValueError("the KIVI cache does not support speculative decoding (--speculative-config)")
    notes = []
    chunk = vllm_config.additional_config[KEY].get("prefix_chunk")
    if chunk is not None and cache.block_size is not None and chunk % cache.block_size:
        raise ValueError(f'--additional-config "kivi": prefix_chunk={chunk} must be a multiple of --block-size '
                         f"{cache.block_size} (vLLM shares whole blocks)")
    if cache.enable_prefix_caching and vllm_config.parallel_config.world_size > 1:
        cache.enable_prefix_caching = False
        notes.append("prefix caching turned off under tensor parallelism: the window copies of a shared prefix "
                     "live in the worker, which must share the scheduler's process")
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    if cache.enable_prefix_caching and cache.block_size is not None and budget is not None:
        chunk = _prefix_chunk(vllm_config)
        if chunk > budget:
            raise ValueError(f"--max-num-batched-tokens {budget} is below the KIVI prefix_chunk ({chunk} tokens): "
                             'prefill chunks end at its multiples under prefix caching; raise it, lower "prefix_chunk", '
                             "or pass --no-enable-prefix-caching")
    return notes


def prefix_settings(vllm_config) -> tuple[int, int]:
    """(chunk, limit in bytes) of prefix caching over KIVI blocks; chunk 0 when it is off."""
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        return 0, 0
    mib = vllm_config.additional_config[KEY].get("prefix_cache_mib", DEFAULT_PREFIX_CACHE_MIB)
    return _prefix_chunk(vllm_config), mib * 2**20


def _prefix_chunk(vllm_config) -> int:
    block = vllm_config.cache_config.block_size
    return vllm_config.additional_config[KEY].get("prefix_chunk", -(-DEFAULT_PREFIX_CHUNK // block) * block)


def window_pool_bytes(vllm_config, config: KIVIConfig) -> int:
    """Bytes of this worker's full-precision window pools (windows.py): per attention layer, keys and
    values of R tokens for each of --max-num-seqs slots and each KV head this worker holds."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    per_slot = model.get_num_kv_heads(parallel) * config.residual_length * model.get_head_size()
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * layers * vllm_config.scheduler_config.max_num_seqs * per_slot * itemsize
