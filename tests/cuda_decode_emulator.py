"""A lane-by-lane Python model of kivi_ops/cuda/decode_attend.cu, so that a CPU-only machine can
check the kernel's index algebra against the reference before any GPU runs it.

It mirrors the kernel statement by statement: which bytes each lane loads, the prmt selectors,
the lop3 masks and magic constants, the fp16x2 fmas (one fp16 rounding, as fma.rn.f16x2), the
fragment registers each lane hands to mma.sync, the p transpose through shared memory, the bias
shuffles and the split/warp/tail scheduling. mma.sync itself is modelled from the PTX ISA's
m16n8k16 fragment layout (which lane holds which element), products exact, sums in float64. What
it cannot catch: compiler or hardware behaviour (that is tests/test_cuda_cpp_kernel.py's GPU part).
Slow by design: small shapes only.
"""

from __future__ import annotations

import math

import numpy as np
import torch

WARPS, CHUNK, HEADS = 4, 32, 8


def h2(bits: int) -> np.ndarray:
    """The two fp16 halves (low, high) of a 32-bit register, as float64."""
    return np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float16).astype(np.float64)


def pack(lo: float, hi: float) -> int:
    """Two values rounded to fp16 (round to nearest even) packed as a register."""
    return int(np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint32)[0])


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def magic(x: int, mask: int) -> int:
    return (x & mask) | 0x64006400


def hfma2(a: int, b: int, c: int) -> int:
    r = h2(a) * h2(b) + h2(c)  # exact in float64 for these operands, then one fp16 rounding
    return int(r.astype(np.float16).view(np.uint32)[0])


CODE_MUL = (0x3C003C00, 0x34003400, 0x2C002C00, 0x24002400)
CODE_ADD = (0xE400E400, 0xDC00DC00, 0xD400D400, 0xCC00CC00)


def codes_at(x: int, bits: int, i: int) -> int:
    """The position-i codes of bytes 0 and 2 (kernel: codes_at<B, I>)."""
    mask = ((1 << bits) - 1) * 0x00010001 << (bits * i)
    return hfma2(magic(x, mask), CODE_MUL[bits * i // 2], CODE_ADD[bits * i // 2])


def mma(c, a, b):
    """c[lane] (4 fp32) += A . B for one warp's fragments a[lane] (4 regs), b[lane] (2 regs)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = h2(a[lane][0]), h2(a[lane][1])
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = h2(a[lane][2]), h2(a[lane][3])
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = h2(b[lane][0]), h2(b[lane][1])
    C = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for k, (r, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            c[lane][k] = float(np.float32(c[lane][k] + C[r, col]))


def word(row: np.ndarray, byte: int, nbytes: int) -> int:
    """Little-endian load of nbytes (1, 2, 4) at byte offset `byte` of a uint8 row."""
    return sum(int(row[byte + i]) << 8 * i for i in range(nbytes))


def k_channel(D, KB, s, tig, e):
    if KB == 2:
        return 16 * (tig * (D // 64) + s // 4) + 4 * (s % 4) + e
    return 4 * (tig * (D // 16) + s) + e


def v_channel(D, VB, mt, g, row8):
    if VB == 2:
        return 4 * (g * (D // 32) + mt // 2) + 2 * (mt % 2) + row8
    return 2 * (g * (D * VB // 64) + mt) + row8


class Rows:
    """The kernel's token_rows for one kv row (b, h): (row, key_row) of token t in the flat code and
    scale buffers, static (bh * N + i) or through the block table (row t % PS of page
    block_table[b, t // PS], key row (t % PS) // G of that page, the id clamped into the pool)."""

    def __init__(self, b, h, H, max_tokens, G, table=None, page_size=0, num_pages=0):
        self.b, self.h, self.H, self.S, self.G = b, h, H, max_tokens, G
        self.table, self.page_size, self.num_pages = table, page_size, num_pages

    def __call__(self, t):
        if self.table is not None:
            return self._paged(t)
        bh = self.b * self.H + self.h
        return bh * self.S + t, bh * (-(-self.S // self.G)) + t // self.G

    def _paged(self, t):
        PS = self.page_size
        j, in_page = t // PS, t % PS
        page = min(max(int(self.table[self.b, j]), 0), self.num_pages - 1)
        ph = page * self.H + self.h
        return ph * PS + in_page, ph * (PS // self.G) + in_page // self.G


def quantized_chunks(q_s, kc, ks, kz, vc, vs, vz, rows, chunks, D, G):
    """One warp over `chunks` (kernel: quantized_chunks); the buffers are flat [rows, ...] and
    `rows` (Rows) addresses them. Returns (m, l, acc) per head in fp32."""
    Gv = min(G, D)
    KB, VB = kc.shape[-1] * 8 // D, vc.shape[-1] * 8 // D
    KROW, VROW, KS, MT = D * KB // 8, D * VB // 8, D // 16, D // 16
    KWPT, VBPT = KROW // 16, VROW // 8
    acc = [[[0.0] * 4 for _ in range(MT)] for _ in range(32)]
    m = [[-math.inf, -math.inf] for _ in range(32)]
    l_ = [[0.0, 0.0] for _ in range(32)]
    for c in chunks:
        t0 = c * CHUNK
        r0, kg = rows(t0)  # the chunk's rows are r0 + 0..31 (one page)
        qk, zdot = [[None] * KS for _ in range(32)], [0.0] * 32
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            for s in range(KS):
                ch = k_channel(D, KB, s, tig, 0)
                qv = q_s[g, ch:ch + 4]
                sv, zv = ks[kg, ch:ch + 4].astype(np.float64), kz[kg, ch:ch + 4].astype(np.float64)
                qk[lane][s] = (pack(qv[0] * sv[0], qv[1] * sv[1]), pack(qv[2] * sv[2], qv[3] * sv[3]))
                zdot[lane] = float(np.float32(zdot[lane] + np.float32((qv * zv).sum())))
        zdot = [zdot[lane] + zdot[lane ^ 1] for lane in range(32)]
        zdot = [zdot[lane] + zdot[lane ^ 2] for lane in range(32)]
        bias = [(zdot[8 * (lane % 4)], zdot[8 * (lane % 4) + 4]) for lane in range(32)]
        sc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
        for mt in range(2):
            words = []
            for lane in range(32):
                g, tig = lane // 4, lane % 4
                words.append([[word(kc[r0 + 16 * mt + g + 8 * r], 4 * KWPT * tig + 4 * i, 4) for i in range(KWPT)]
                              for r in range(2)])
            for s in range(KS):
                a = []
                for lane in range(32):
                    w0, w1 = words[lane]
                    if KB == 2:
                        sel = (s % 4) * 0x0101
                        x0, x1 = prmt(w0[s // 4], 0, sel), prmt(w1[s // 4], 0, sel)
                        a.append((hfma2(magic(x0, 0x000C0003), 0x34003C00, 0xDC00E400),
                                  hfma2(magic(x1, 0x000C0003), 0x34003C00, 0xDC00E400),
                                  hfma2(magic(x0, 0x00C00030), 0x24002C00, 0xCC00D400),
                                  hfma2(magic(x1, 0x00C00030), 0x24002C00, 0xCC00D400)))
                    else:
                        lo = 2 * (s % 2) * 0x0101
                        hi = lo + 0x0101
                        xs = (prmt(w0[s // 2], 0, lo), prmt(w1[s // 2], 0, lo), prmt(w0[s // 2], 0, hi),
                              prmt(w1[s // 2], 0, hi))
                        a.append(tuple(hfma2(magic(x, 0x00F0000F), 0x2C003C00, 0xD400E400) for x in xs))
                mma(sc[mt], a, [qk[lane][s] for lane in range(32)])
        # online softmax, heads 2 tig (c0, c2) and 2 tig + 1 (c1, c3)
        mx = [[max(sc[0][lane][j], sc[0][lane][j + 2], sc[1][lane][j], sc[1][lane][j + 2]) + bias[lane][j]
               for j in range(2)] for lane in range(32)]
        for off in (4, 8, 16):
            mx = [[max(mx[lane][j], mx[lane ^ off][j]) for j in range(2)] for lane in range(32)]
        p_s = np.zeros((HEADS, 36))
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            n = [max(m[lane][j], mx[lane][j]) for j in range(2)]
            al = [2.0 ** (m[lane][j] - n[j]) if m[lane][j] != -math.inf else 0.0 for j in range(2)]
            m[lane] = n
            l_[lane] = [l_[lane][j] * al[j] for j in range(2)]
            for mt in range(2):
                p = [2.0 ** (sc[mt][lane][k] + bias[lane][k % 2] - n[k % 2]) for k in range(4)]
                l_[lane][0] += p[0] + p[2]
                l_[lane][1] += p[1] + p[3]
                p_s[2 * tig, 16 * mt + g], p_s[2 * tig + 1, 16 * mt + g] = p[0], p[1]
                p_s[2 * tig, 16 * mt + g + 8], p_s[2 * tig + 1, 16 * mt + g + 8] = p[2], p[3]
            for mt in range(MT):
                acc[lane][mt] = [acc[lane][mt][k] * al[k % 2] for k in range(4)]
        for kstep in range(2):
            a_regs = [[None] * MT for _ in range(32)]
            b = []
            for lane in range(32):
                g, tig = lane // 4, lane % 4
                pv = p_s[g, 16 * kstep + 4 * tig:16 * kstep + 4 * tig + 4]
                b.append((pack(pv[0], pv[1]), pack(pv[2], pv[3])))
                t = r0 + 16 * kstep + 4 * tig  # a row of the flat buffers
                w = [[word(vc[t + e], g * VBPT + 4 * i, min(VBPT, 4)) for i in range(max(VBPT // 4, 1))]
                     for e in range(4)]
                vg = g * (D // 8) // Gv
                S01, S23 = pack(vs[t, vg], vs[t + 1, vg]), pack(vs[t + 2, vg], vs[t + 3, vg])
                Z01, Z23 = pack(vz[t, vg], vz[t + 1, vg]), pack(vz[t + 2, vg], vz[t + 3, vg])
                for j in range(VBPT):
                    sel = (j % 4) | ((4 + j % 4) << 8)
                    x01, x23 = prmt(w[0][j // 4], w[1][j // 4], sel), prmt(w[2][j // 4], w[3][j // 4], sel)
                    # VB = 2: m-tiles 2j, 2j + 1 hold codes (0, 1), (2, 3) of byte j; VB = 4: m-tile j its nibbles
                    tiles = 2 if VB == 2 else 1
                    for half in range(tiles):
                        i0, i1 = 2 * half, 2 * half + 1
                        a_regs[lane][tiles * j + half] = (
                            hfma2(codes_at(x01, VB, i0), S01, Z01), hfma2(codes_at(x01, VB, i1), S01, Z01),
                            hfma2(codes_at(x23, VB, i0), S23, Z23), hfma2(codes_at(x23, VB, i1), S23, Z23))
            for mt in range(MT):
                cm = [acc[lane][mt] for lane in range(32)]
                mma(cm, [a_regs[lane][mt] for lane in range(32)], b)
        # (the kernel's __syncwarp()s order the p_s writes and reads; sequential here)
    for off in (4, 8, 16):
        l_ = [[l_[lane][j] + l_[lane ^ off][j] for j in range(2)] for lane in range(32)]
    out_m, out_l, out_acc = np.full(HEADS, -math.inf), np.zeros(HEADS), np.zeros((HEADS, D))
    for lane in range(32):
        g, tig = lane // 4, lane % 4
        for mt in range(MT):
            ch = v_channel(D, VB, mt, g, 0)
            out_acc[2 * tig, ch], out_acc[2 * tig + 1, ch] = acc[lane][mt][0], acc[lane][mt][1]
            out_acc[2 * tig, ch + 1], out_acc[2 * tig + 1, ch + 1] = acc[lane][mt][2], acc[lane][mt][3]
        if g == 0:
            out_m[2 * tig:2 * tig + 2], out_l[2 * tig:2 * tig + 2] = m[lane], l_[lane]
    return out_m, out_l, out_acc


def tail_tokens(q_s, kc, ks, kz, kres, vc, vs, vz, vres, rows, tokens, nqk, nqv, qg, D, G):
    """One warp's tail tokens in fp32 (kernel: tail_tokens), all lanes at once; code and scale
    buffers flat, addressed by `rows` (Rows), the residuals [W, D] of the kv row."""
    Gv = min(G, D)
    KB, VB = kc.shape[-1] * 8 // D, vc.shape[-1] * 8 // D
    m, l_, acc = np.full(HEADS, -math.inf), np.zeros(HEADS), np.zeros((HEADS, D))
    ch = np.arange(D)
    for t in tokens:
        (row, kr), slot = rows(t), t % kres.shape[0]
        if t < nqk:
            code = (kc[row, ch * KB // 8].astype(np.int64) >> (KB * (ch % (8 // KB)))) & ((1 << KB) - 1)
            k = code * ks[kr].astype(np.float64) + kz[kr].astype(np.float64)
        else:
            k = kres[slot].astype(np.float64)
        if t < nqv:
            code = (vc[row, ch * VB // 8].astype(np.int64) >> (VB * (ch % (8 // VB)))) & ((1 << VB) - 1)
            v = code * vs[row, ch // Gv].astype(np.float64) + vz[row, ch // Gv].astype(np.float64)
        else:
            v = vres[slot].astype(np.float64)
        for n in range(qg):
            s = float(q_s[n] @ k)
            mn = max(m[n], s)
            alpha, p = (2.0 ** (m[n] - mn) if m[n] != -math.inf else 0.0), 2.0 ** (s - mn)
            m[n], l_[n] = mn, l_[n] * alpha + p
            acc[n] = acc[n] * alpha + p * v
    return m, l_, acc


def merge(states):
    """Softmax merge of (m, l, acc) states (the kernel's warp merge and the split merge kernel)."""
    ms = np.stack([s[0] for s in states])
    M = ms.max(axis=0)
    f = np.where(np.isfinite(ms), np.exp2(ms - np.where(np.isfinite(M), M, 0)[None]), 0.0)
    return M, (f * np.stack([s[1] for s in states])).sum(0), (f[..., None] * np.stack([s[2] for s in states])).sum(0)


def emulate_decode(query, layer, counts, params, scale, num_splits, pages=None):
    """decode_attend.cu's output for query [B, Hq, 1, D] (fp16) over a 2/4-bit fp16 layer on CPU;
    pages (a paged_layout.Paging): the layer is paged, read through its block table."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = (t.numpy() for t in layer.kivi)
    B, Hq, _, D = query.shape
    H = k_codes.shape[1]
    if pages is None:
        S, paging = k_codes.shape[2], {}
    else:
        S = pages.capacity
        paging = dict(table=pages.block_table.numpy(), page_size=k_codes.shape[2], num_pages=k_codes.shape[0])
    flat = [x.reshape(-1, x.shape[-1]) for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)]
    qg, G, R = Hq // H, params.group_size, params.residual_length
    out = np.zeros((B, Hq, D), dtype=np.float16)
    for b in range(B):
        L = int(lengths[b]) if counts is None or int(counts[b]) != 0 else 0
        if params.flush_policy:
            nqk = nqv = max(L - R, 0) // G * G
        else:
            nqk, nqv = L // R * R, max(L - R, 0)
        chunks = min(nqk, nqv) // CHUNK
        per = -(-chunks // num_splits)
        for h, head0 in ((h, head0) for h in range(H) for head0 in range(0, qg, HEADS)):  # the blocks' tiles
            heads = min(HEADS, qg - head0)
            first = h * qg + head0  # the tile's first query head
            q_s = np.zeros((HEADS, D))
            q_s[:heads] = query[b, first:first + heads, 0].double().numpy() * np.float32(scale * 1.4426950408889634)
            q_s = q_s.astype(np.float32).astype(np.float64)
            splits = []
            rows = Rows(b, h, H, S, G, **paging)
            kc, ks, kz, vc, vs, vz = flat
            for split in range(num_splits):
                begin, end = split * per, min(split * per + per, chunks)
                splits.append(merge([quantized_chunks(q_s, kc, ks, kz, vc, vs, vz, rows, range(begin + w, end, WARPS),
                                                      D, G) for w in range(WARPS)]))
            splits.append(merge([tail_tokens(q_s, kc, ks, kz, k_res[b, h], vc, vs, vz, v_res[b, h], rows,
                                             range(chunks * CHUNK + w, L, WARPS), nqk, nqv, heads, D, G)
                                 for w in range(WARPS)]))
            M, l_, acc = merge(splits)
            o = np.where(l_[:, None] > 0, acc / np.where(l_ > 0, l_, 1)[:, None], 0.0)
            out[b, first:first + heads] = np.clip(o[:heads], -65504, 65504).astype(np.float16)
    return torch.from_numpy(out).reshape(B, Hq, 1, D)
