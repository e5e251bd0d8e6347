"""CPU_ATTN as vLLM ships it, plus a KIVI cache when `--additional-config '{"kivi": {...}}'` is given.

With the config: each block (PS = --block-size tokens) holds the KIVI-quantized pages of its tokens
(kivi_ops/cache/byte_pages.py: codes and fp scales/zeros, the bytes vLLM's allocator counts through
customize_spec); each request's full-precision window (KIVI's last R tokens) lives in a per-layer
window pool outside the blocks (windows.py). Attention runs kivi_ops.cache.varlen (planned once per step
by the metadata builder, run per layer), which calls the library's paged ops through its one dispatcher. Without the config every method
is CPU_ATTN's own."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kivi_ops import KIVIConfig
from kivi_ops.cache.byte_pages import page_bytes, pool_views
from kivi_ops.layout import LayerTensors, QuantParams
from kivi_ops.cache import varlen
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from .options import kivi_options, prefix_settings
from .prefix_tails import TAILS, boundary_keys
from .windows import SLOTS

log = logging.getLogger(__name__)


# The engine's KIVI config, set by every attention layer as the model is built (vLLM asks
# customize_spec later, outside its config context). None: CPU_ATTN unchanged.
ACTIVE: dict[str, Optional[KIVIConfig]] = {"config": None}


def _current() -> Optional[KIVIConfig]:
    return ACTIVE["config"]


class KIVIAttentionBackend(CPUAttentionBackend):
    @classmethod
    def customize_spec(cls, spec):
        config = _current()
        if config is None:
            return super().customize_spec(spec)
        PS, D = spec.block_size, spec.head_size
        per_head = page_bytes(config, 1, PS, D, spec.dtype)
        if per_head % PS:
            raise ValueError(f"the KIVI page of head_dim={D}, group_size={config.group_size}, {spec.dtype} is "
                             f"{per_head} bytes per head for {PS} tokens: not a whole number per token")
        return replace(spec, state_content_bytes=per_head // PS)

    @staticmethod
    def get_impl_cls():
        return KIVIAttentionImpl

    @staticmethod
    def get_builder_cls():
        return KIVIMetadataBuilder


@dataclass
class KIVIMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    rows: torch.Tensor  # each request's window slot (windows.py)
    plan: varlen.VarlenPlan  # the step's runs, the same for every layer
    restores: dict  # batch row -> the key of the cached prefix it starts from
    saves: dict  # (batch row, boundary) -> key: the prompt boundaries this step reaches


class KIVIMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kivi = kivi_options(vllm_config)
        if self.kivi is None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        # CPU_ATTN's own set-up picks an ISA for its 16-bit kernels, which never run here.
        super(CPUAttentionMetadataBuilder, self).__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.window_slots = vllm_config.scheduler_config.max_num_seqs
        SLOTS.reserve(self.window_slots)
        self.prefix_chunk, limit = prefix_settings(vllm_config)
        TAILS.configure(self.prefix_chunk, limit)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self.kivi is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        SLOTS.record(m.num_reqs, m.query_start_loc, m.seq_lens)
        rows, fresh = SLOTS.rows(m.num_reqs)
        restores, saves = self._prefix_plan(m, fresh)
        plan = varlen.plan(rows, m.block_table_tensor, m.query_start_loc, m.seq_lens, m.slot_mapping,
                           self.kv_cache_spec.block_size, self.kivi.residual_length, self.window_slots,
                           self.prefix_chunk or None)
        return KIVIMetadata(num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc,
                            seq_lens=m.seq_lens, block_table=m.block_table_tensor, slot_mapping=m.slot_mapping,
                            rows=rows, plan=plan, restores=restores, saves=saves)

    def _prefix_plan(self, m, fresh: list[int]) -> tuple[dict, dict]:
        """Which rows start from a cached prefix (a new request past token 0) and which prompt
        boundaries this step reaches (prefix_tails.py)."""
        N, qsl, sl = self.prefix_chunk, m.query_start_loc.tolist(), m.seq_lens.tolist()
        restores, saves = {}, {}
        for b in range(m.num_reqs):
            ctx = sl[b] - (qsl[b + 1] - qsl[b])
            starts_cached = b in fresh and ctx > 0
            if starts_cached and not N:
                raise RuntimeError(f"a request starts at token {ctx} with no window: the KIVI cache needs "
                                   "prefix caching on for that (or a KV connector, which it refuses)")
            if not N:
                continue
            state = SLOTS.request(b)
            prompt_len = len(state.prompt_token_ids)
            reach = min(sl[b], prompt_len)  # copies are kept at prompt boundaries only
            start, frontier = min(ctx, prompt_len) // N * N, reach // N * N
            keys = ()  # a decode step neither starts from a prefix nor reaches a prompt boundary
            if starts_cached or frontier > start:
                keys = boundary_keys(state.prompt_token_ids + state.output_token_ids, N, max(reach, ctx))
            if starts_cached:
                if ctx % N:
                    raise RuntimeError(f"a request starts from a cached prefix of {ctx} tokens, not a multiple of "
                                       f"the KIVI prefix_chunk={N} (the scheduler hook was bypassed)")
                restores[b] = keys[ctx // N - 1]
                TAILS.hits += 1
            for end in range((ctx // N + 1) * N, reach + 1, N):
                saves[b, end] = keys[end // N - 1]
            # Chunks end at boundaries or at the prefill's end: the blocks below the last prompt boundary
            # reached are clean, those of tokens past it are not (prefix_tails.py).
            PS = self.kv_cache_spec.block_size
            TAILS.mark(m.block_table_tensor[b, :-(-sl[b] // PS)].tolist(), keys, start, frontier, (ctx, sl[b]), PS)
        TAILS.evict(keep=set(restores.values()))
        return restores, saves


class KIVIAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        vllm_config = get_current_vllm_config()
        self.kivi = ACTIVE["config"] = kivi_options(vllm_config)
        if self.kivi is None:
            return
        refused = {"sliding-window attention": sliding_window is not None,
                   "ALiBi": alibi_slopes is not None, "attention-logit soft-capping": bool(logits_soft_cap),
                   "attention sinks": sinks is not None, f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
                   "KV sharing between layers": kv_sharing_target_layer_name is not None}
        for what, present in refused.items():
            if present:
                raise ValueError(f"the KIVI cache does not support {what} (a layer of this model has it); "
                                 'serve this model without --additional-config "kivi"')
        self.dtype = vllm_config.model_config.dtype
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        c = self.kivi
        self.params = QuantParams(c.k_bits, c.v_bits, c.group_size, c.residual_length)
        self.windows = None

    def _windows(self):
        if self.windows is None:
            shape = (self.max_num_seqs, self.num_kv_heads, self.kivi.residual_length, self.head_size)
            self.windows = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
        return self.windows

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.kivi is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the KIVI backend")
        if attn_metadata is None:  # warm-up
            return output
        m, n = attn_metadata, attn_metadata.num_actual_tokens
        pools = pool_views(kv_cache, self.kivi, self.num_kv_heads, self.block_size, self.head_size, self.dtype)
        k_window, v_window = self._windows()
        name = layer.layer_name
        for b, prefix in m.restores.items():
            k, v = TAILS.load(prefix, name)
            k_window[m.rows[b]].copy_(k)
            v_window[m.rows[b]].copy_(v)

        def on_boundary(b, end):
            prefix = m.saves.get((b, end))
            if prefix is not None:
                TAILS.save(prefix, name, k_window[m.rows[b]], v_window[m.rows[b]])
        tensors = LayerTensors(pools["k_codes"], pools["k_scale"], pools["k_zero"], k_window, pools["v_codes"],
                               pools["v_scale"], pools["v_zero"], v_window, m.seq_lens)
        out = varlen.run(
            m.plan, query[:n].view(n, self.num_heads, self.head_size), key[:n].view(n, self.num_kv_heads, self.head_size),
            value[:n].view(n, self.num_kv_heads, self.head_size), tensors, k_window, v_window, self.params, self.scale,
            on_boundary=on_boundary if m.saves else None)
        output[:n].view(n, self.num_heads, self.head_size).copy_(out)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.kivi is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # forward appends (the append and the attention of a prompt's chunk go together)
