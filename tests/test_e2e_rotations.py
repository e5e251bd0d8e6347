"""lab/e2e_rotations.py's teacher-forced forward quantized as the decode cache: exact where the cache
keeps tokens exact, quantized only where the cache has flushed them."""

import torch
import torch.nn.functional as F

from lab.e2e_rotations import _decode_attention, _fake

B, H, HQ, T, D = 1, 2, 4, 128, 16


class _Module:
    layer_idx = 0

    def __init__(self, residual_length, sink_tokens=0):
        eye = torch.eye(D).expand(H, D, D)
        self.config = type("C", (), dict(kivi_e2e=dict(widths=[(2, 2)], matrices=lambda i: (eye, eye), group_size=32,
                                                       residual_length=residual_length, sink_tokens=sink_tokens)))


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, T, D, generator=g), torch.randn(B, H, T, D, generator=g),
            torch.randn(B, H, T, D, generator=g))


def _sdpa(q, k, v):
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(HQ // H, 1), v.repeat_interleave(HQ // H, 1),
                                         is_causal=True)
    return out.transpose(1, 2)


def test_a_window_over_the_whole_sequence_is_exact_attention():
    q, k, v = _qkv()
    out, _ = _decode_attention(_Module(residual_length=2 * T), q, k, v, None)  # (at R tokens the block flushes)
    torch.testing.assert_close(out, _sdpa(q, k, v))


def test_tokens_are_quantized_exactly_where_the_cache_flushed_them():
    q, k, v = _qkv(1)
    out, _ = _decode_attention(_Module(residual_length=32, sink_tokens=1), q, k, v, None)
    kq, vq = _fake(k, torch.eye(D).expand(H, D, D), 2, 32, "channel"), _fake(v, torch.eye(D).expand(H, D, D), 2, 16,
                                                                                "token")
    for i in (0, 30, 31, 64, 127):  # query i sees keys quantized below (i + 1) // 32 * 32, values below i + 1 - 32
        nk, nv = (i + 1) // 32 * 32, max(i + 1 - 32, 0)
        keys = torch.cat([k[:, :, :1], kq[:, :, 1:nk], k[:, :, nk:i + 1]], 2) if nk > 1 else k[:, :, :i + 1]
        values = torch.cat([v[:, :, :1], vq[:, :, 1:nv], v[:, :, nv:i + 1]], 2) if nv > 1 else v[:, :, :i + 1]
        want = F.scaled_dot_product_attention(q[:, :, i:i + 1], keys.repeat_interleave(2, 1),
                                              values.repeat_interleave(2, 1))
        torch.testing.assert_close(out[:, i], want[:, :, 0])
