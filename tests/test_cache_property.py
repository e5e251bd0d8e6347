"""Property test: random sequences of append / attend / reset / restart_rows on a KIVICache,
checked after every operation against a token-by-token reference written here.

The reference knows nothing of the cache's buffers (ring-buffer slots, packed codes, flush
arithmetic) nor of the library's quantize ops: per sequence it keeps the list of exact tokens
pushed so far and applies KIVI's policy (Algorithm 1) one token at a time, with the paper's
min/max rule written out below:
  keys:   when R exact keys have accumulated, those R are fake-quantized per channel in groups of
          G tokens (the key flush; the test counts them);
  values: a value is fake-quantized per token, in groups of min(G, D) channels, when it leaves the
          window of the last R tokens;
  sinks:  (sink_tokens, the pool) the first N tokens stay exact and are kept out of their key
          group's min / max.
Attention is a plain softmax, in float64, over those keys and values: query i of row b sits at
position lengths[b] - counts[b] + i and sees positions <= its own; rows i >= counts[b], and
queries that see no key, are zeros.

Both the eager cache (the kivi ops -> the CPU reference kernels) and a `portable` cache (the
decomposed append and materialized attention, what ONNX / ExecuTorch run) follow every sequence
in lock step; q_len = 1 queries also run the decode form of torch.compile (decomposed_fused)
directly on the eager cache's buffers.

Tolerances:
- cache.dequantized: exact (torch.equal). The cache and the reference compute the same IEEE fp32
  operations (min, max, (max - min) / (2^B - 1), floor((x - zero) / scale + 0.5), q * scale +
  zero) on the same fp32 inputs; each is correctly rounded, so no rounding difference can arise.
  A mismatch is a wrong code, group or token (a full quantization step or more), never rounding.
- attend: a first-order bound of fp32 rounding (u = 2^-24), computed per output element from the
  data (`reference_attend`). A score q.k over D channels is computed, in any order and either
  directly or folded ((q s) . c + q . z), with error at most
      delta_t = (D + 4) u sum_d |q_d scale| (|k_td| + 2 |z_td|)
  (|c s| = |k - z| <= |k| + |z|; z is the key's zero point, 0 for exact keys). With
  Delta = max_t delta_t, each softmax weight is off by a relative 2 Delta + 8 u at most (score,
  max subtraction, exp, normalization, the online softmax's corrections), and summing T weighted
  values (directly or folded with the value zero points) adds at most (2T + 8) u of
  sum_t w_t (|v_t| + 2 |zv_t|). The tolerance is twice the sum of both (second-order terms).
  It is 6e-5 (median) to 2.5e-4 here, and the errors measured stay under 2% of it (at most
  1.4e-6); a wrong token or mask moves the output by w_t |v_t| ~ 1e-2, and scaling the scores
  by 1.001 is already caught.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.dispatch import implementations

U = 2.0 ** -24


# ---------------------------------------------------------------- the reference


def minmax_fake_quantize(x: torch.Tensor, bits: int, dim: int, keep: torch.Tensor | None = None):
    """KIVI's asymmetric rule over groups along `dim` of fp32 x: zero = min, scale = (max - min) /
    (2^B - 1), q = clamp(floor((x - zero) / scale + 0.5)), x' = q scale + zero. keep (broadcast to
    x): the elements that enter the group's min / max. Returns (x', zero broadcast to x)."""
    if keep is None:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    else:
        lo = x.masked_fill(~keep, float("inf")).amin(dim, keepdim=True)
        hi = x.masked_fill(~keep, float("-inf")).amax(dim, keepdim=True)
        lo, hi = torch.nan_to_num(lo, posinf=0.0), torch.nan_to_num(hi, neginf=0.0)  # nothing kept
    scale = (hi - lo) / (2**bits - 1)
    q = torch.floor((x - lo) / torch.where(scale == 0, torch.ones_like(scale), scale) + 0.5).clamp(0, 2**bits - 1)
    return q * scale + lo, lo.expand_as(x)


class SequenceReference:
    """One sequence: the exact tokens pushed so far and, token by token, what attention sees."""

    def __init__(self, cfg: KIVIConfig):
        self.cfg = cfg
        self.exact_k, self.exact_v = [], []  # [H, D] per token
        self.k, self.v, self.k_zero, self.v_zero = [], [], [], []  # as attention sees them
        self.quantized_keys = 0
        self.flushes = 0

    def __len__(self):
        return len(self.exact_k)

    def push(self, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cfg
        R, G, sink = c.residual_length, c.group_size, c.sink_tokens
        zeros = torch.zeros_like(k)
        self.exact_k.append(k)
        self.exact_v.append(v)
        self.k.append(k)
        self.v.append(v)
        self.k_zero.append(zeros)
        self.v_zero.append(zeros)
        t0 = self.quantized_keys
        if len(self) - t0 == R:  # the residual is full: quantize its R keys, per channel, G tokens a group
            H, D = k.shape
            block = torch.stack(self.exact_k[t0:], dim=1).reshape(H, R // G, G, D)
            keep = (torch.arange(t0, t0 + R) >= sink).view(1, R // G, G, 1)  # sinks stay out of the statistics
            kq, kz = minmax_fake_quantize(block, c.k_bits, 2, keep)
            for j, t in enumerate(range(t0, t0 + R)):
                if t >= sink:  # sinks are seen exact (the pool)
                    self.k[t], self.k_zero[t] = kq.reshape(H, R, D)[:, j], kz.reshape(H, R, D)[:, j]
            self.quantized_keys += R
            self.flushes += 1
        leaving = len(self) - R - 1  # the value leaving the window of the last R tokens
        if leaving >= sink:
            H, D = v.shape
            gv = min(G, D)
            vq, vz = minmax_fake_quantize(self.exact_v[leaving].reshape(H, D // gv, gv), c.v_bits, 2)
            self.v[leaving], self.v_zero[leaving] = vq.reshape(H, D), vz.reshape(H, D)


def reference_dequantized(seqs, H, D):
    """(keys, values) [B, H, max length, D] as the cache's dequantized() returns them."""
    n = max(len(s) for s in seqs)
    keys, values = torch.zeros(len(seqs), H, n, D), torch.zeros(len(seqs), H, n, D)
    for b, s in enumerate(seqs):
        if len(s):
            keys[b, :, : len(s)] = torch.stack(s.k, dim=1)
            values[b, :, : len(s)] = torch.stack(s.v, dim=1)
    return keys, values


def reference_attend(seqs, query, scale, counts):
    """(output, tolerance) [B, Hq, q, D], float64: plain softmax over each sequence's keys and
    values as attention sees them, and the fp32 rounding bound of the module docstring."""
    B, Hq, q, D = query.shape
    out, tol = torch.zeros(B, Hq, q, D, dtype=torch.float64), torch.zeros(B, Hq, q, D, dtype=torch.float64)
    for b, s in enumerate(seqs):
        L, c = len(s), q if counts is None else int(counts[b])
        if L == 0:
            continue
        H = s.k[0].shape[0]

        def stacked(rows):
            return torch.stack(rows, dim=1).double().repeat_interleave(Hq // H, dim=0)  # [Hq, L, D]

        k, v, kz, vz = stacked(s.k), stacked(s.v), stacked(s.k_zero), stacked(s.v_zero)
        for i in range(c):  # rows i >= counts[b] are padding: zeros
            p = L - c + i
            if p < 0:  # before the sequence's first token: no visible key
                continue
            qs = query[b, :, i].double() * scale  # [Hq, D]
            scores = (qs[:, None, :] * k[:, : p + 1]).sum(-1)  # [Hq, T]
            w = torch.softmax(scores, dim=-1)
            out[b, :, i] = (w[:, :, None] * v[:, : p + 1]).sum(1)
            delta = (D + 4) * U * (qs.abs()[:, None, :] * (k[:, : p + 1].abs() + 2 * kz[:, : p + 1].abs())).sum(-1)
            weights_err = (2 * delta.amax(-1) + 8 * U)[:, None] * (w[:, :, None] * v[:, : p + 1].abs()).sum(1)
            sum_err = (2 * (p + 1) + 8) * U * (w[:, :, None] * (v[:, : p + 1].abs() + 2 * vz[:, : p + 1].abs())).sum(1)
            tol[b, :, i] = 2 * (weights_err + sum_err)
    return out, tol


# ---------------------------------------------------------------- random runs


def tokens(gen, style, shape):
    """randn; a small integer grid (rounding ties, constant groups); or one vector repeated over
    the tokens (constant key channels: scale 0)."""
    if style == "grid":
        return torch.randint(-4, 5, shape, generator=gen).float()
    if style == "repeat":
        return torch.randn(*shape[:2], 1, shape[3], generator=gen).expand(shape).contiguous()
    return torch.randn(shape, generator=gen)


@st.composite
def cache_runs(draw, max_ops: int):
    G, R = draw(st.sampled_from([(4, 8), (4, 16), (8, 8), (8, 16)]))
    cfg = KIVIConfig(k_bits=draw(st.sampled_from([2, 4, 8])), v_bits=draw(st.sampled_from([2, 4, 8])),
                     group_size=G, residual_length=R, sink_tokens=draw(st.sampled_from([0, 0, 0, 1, 5])))
    shape = dict(B=draw(st.integers(1, 3)), H=draw(st.integers(1, 2)), D=draw(st.sampled_from([8, 16])),
                 S=draw(st.sampled_from([64, 96, 128])), groups=draw(st.integers(1, 2)))
    B = shape["B"]
    ops = []
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["append"] * 4 + ["attend"] * 3 + ["reset", "restart"]))
        if kind == "append":
            n = draw(st.one_of(st.integers(0, 3), st.integers(0, 3 * R + 3)))
            per_row = st.one_of(st.just(0), st.just(n), st.integers(0, n))
            counts = draw(st.one_of(st.none(), st.lists(per_row, min_size=B, max_size=B)))
            ops.append(("append", n, counts, draw(st.sampled_from(["randn", "randn", "grid", "repeat"]))))
        elif kind == "attend":
            q = draw(st.integers(1, 4))
            per_row = st.one_of(st.just(0), st.just(q), st.integers(0, q))
            ops.append(("attend", q, draw(st.one_of(st.none(), st.lists(per_row, min_size=B, max_size=B)))))
        elif kind == "restart":
            ops.append(("restart", draw(st.lists(st.booleans(), min_size=B, max_size=B))))
        else:
            ops.append(("reset",))
    return cfg, shape, ops, draw(st.integers(0, 2**31 - 1))


def check_run(cfg, shape, ops, seed, stats) -> None:
    B, H, D, S, groups = shape["B"], shape["H"], shape["D"], shape["S"], shape["groups"]
    caches = []
    for portable in (False, True):
        caches.append(KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                                portable=portable))
    seqs = [SequenceReference(cfg) for _ in range(B)]
    gen = torch.Generator().manual_seed(seed)
    scale = D ** -0.5
    stats["runs"] += 1
    stats["runs with sinks"] += cfg.sink_tokens > 0
    for op in ops:
        stats[op[0]] += 1
        if op[0] == "append":
            _, n, counts, style = op
            room = [S - len(s) for s in seqs]
            if counts is None and n > min(room):
                n = min(room)  # stay within capacity (overflow has its own tests)
            counts = None if counts is None else [min(c, r) for c, r in zip(counts, room)]
            key, value = tokens(gen, style, (B, H, n, D)), tokens(gen, style, (B, H, n, D))
            counts_t = None if counts is None else torch.tensor(counts)
            for cache in caches:
                cache.layers[0].append(key, value, Step(counts=counts_t))
            for b, s in enumerate(seqs):
                c = n if counts is None else counts[b]
                stats["zero-count rows"] += c == 0 and counts is not None
                stats["full rows"] += c == n > 0 and counts is not None
                for t in range(c):
                    s.push(key[b, :, t], value[b, :, t])
            want = reference_dequantized(seqs, H, D)
            for cache in caches:
                assert cache.lengths().tolist() == [len(s) for s in seqs]
                got = cache.layers[0].dequantized()
                assert torch.equal(got[0], want[0]), f"keys differ (portable={cache.layers[0].portable})"
                assert torch.equal(got[1], want[1]), f"values differ (portable={cache.layers[0].portable})"
        elif op[0] == "attend":
            _, q, counts = op
            query = torch.randn(B, H * groups, q, D, generator=gen)
            counts_t = None if counts is None else torch.tensor(counts)
            want, tol = reference_attend(seqs, query, scale, counts)
            outs = {f"portable={cache.layers[0].portable}": cache.layers[0].attend(query, Step(counts=counts_t)) for cache in caches}
            if q == 1:
                eager = caches[0]
                outs["decomposed_fused"] = implementations.run_attend("decomposed_fused", query, eager.layers[0].tensors(),
                                                               counts_t, eager.layers[0].params, scale)
            for name, out in outs.items():
                err = (out.double() - want).abs()
                assert (err <= tol).all(), (
                    f"{name}: error {err.max():.3g} over tolerance at {(err > tol).nonzero()[0].tolist()}")
            stats["attended queries"] += int((tol > 0).any(-1).sum())
        elif op[0] == "restart":
            fresh = op[1]
            for cache in caches:
                cache.restart_rows(torch.tensor(fresh))
            stats["flushes"] += sum(s.flushes for s, f in zip(seqs, fresh) if f)
            seqs = [SequenceReference(cfg) if f else s for s, f in zip(seqs, fresh)]
        else:
            for cache in caches:
                cache.reset()
            stats["flushes"] += sum(s.flushes for s in seqs)
            seqs = [SequenceReference(cfg) for _ in range(B)]
    stats["flushes"] += sum(s.flushes for s in seqs)


def run_property(max_examples: int, max_ops: int, derandomize: bool) -> collections.Counter:
    stats = collections.Counter()

    @settings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(run=cache_runs(max_ops))
    def prop(run):
        check_run(*run, stats)

    prop()
    return stats


def test_random_operation_sequences_match_the_token_by_token_reference():
    stats = run_property(max_examples=60, max_ops=10, derandomize=True)
    # The run must prove what it claims: key flushes (checked exactly after every append), the
    # corner cases of right padding, resets, sinks.
    assert stats["flushes"] >= 100, stats  # 194 with these settings (derandomized: the same every run)
    for what in ("zero-count rows", "full rows", "reset", "restart", "runs with sinks", "attended queries"):
        assert stats[what] > 0, (what, stats)


@pytest.mark.slow
def test_random_operation_sequences_match_the_token_by_token_reference_long():
    stats = run_property(max_examples=400, max_ops=16, derandomize=False)
    assert stats["flushes"] >= 200, stats
