"""What vLLM hands the KIVI backend and what it returns, per layer and request, so a test can run
the library's own cache layer on exactly those queries, keys and values (no model numerics between)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from kivi_ops import KIVIConfig, Step, dispatch
from kivi_ops.cache.static import KIVICache


@contextlib.contextmanager
def captured(records: list):
    """Append (layer name, query_start_loc, q, k, v, out) of every KIVI forward to records."""
    from kivi_vllm import backend

    forward = backend.KIVIAttentionImpl.forward

    def recording(self, layer, query, key, value, kv_cache, m, output, *args, **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, m, output, *args, **kwargs)
        if m is not None:
            n = m.num_actual_tokens
            records.append((layer.layer_name, m.query_start_loc.tolist(), query[:n].clone(), key[:n].clone(),
                            value[:n].clone(), output[:n].clone()))
        return result

    backend.KIVIAttentionImpl.forward = recording
    try:
        yield records
    finally:
        backend.KIVIAttentionImpl.forward = forward


def per_request(records: list, trace: list, prompt: tuple, head_dim: int) -> dict:
    """{layer name: (q, k, v, out) [tokens, heads, head_dim]} of one request, in position order."""
    layers = len(records) // len(trace)
    parts: dict = {}
    for s, step in enumerate(trace):
        for name, qsl, *tensors in records[s * layers:(s + 1) * layers]:
            for b, (p, _, _) in enumerate(step):
                if p == prompt:
                    parts.setdefault(name, []).append([t[qsl[b]:qsl[b + 1]].view(qsl[b + 1] - qsl[b], -1, head_dim)
                                                       for t in tensors])
    return {name: [torch.cat(ts) for ts in zip(*chunks)] for name, chunks in parts.items()}


@torch.no_grad()
def library_layer_out(q, k, v, schedule: list, config: KIVIConfig, scale: float) -> torch.Tensor:
    """The library's KIVILayer over vLLM's schedule of one request (exact prefill on a chunk at 0,
    append then attend after): its attention output [tokens, heads, head_dim]."""
    T, H, D = k.shape
    layer = None
    outs = []
    with dispatch.cpu_kernels("reference"):
        for ctx, n in schedule:
            qq, kk, vv = (t[ctx:ctx + n].transpose(0, 1)[None].contiguous() for t in (q, k, v))
            if ctx == 0:
                outs.clear()
                layer = KIVICache(config, num_layers=1, batch_size=1, max_seq_len=max(T, config.residual_length),
                                  num_kv_heads=H, head_dim=D, dtype=k.dtype, device=k.device).layers[0]
                layer.append(kk, vv, Step(counts=torch.tensor([n]), prefill=True))
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
            else:
                layer.append(kk, vv, Step())
                o = layer.attend(qq, Step(), scale)
            outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)
