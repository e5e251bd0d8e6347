"""A lane-by-lane Python model of kivi_ops/kernels/cuda/decode_attend.cu, so that a CPU-only machine can
check the kernel's index algebra against the reference before any GPU runs it.

It mirrors the kernel statement by statement: which bytes each lane loads, the prmt selectors,
the lop3 masks and magic constants, the fp16x2 fmas (one fp16 rounding, as fma.rn.f16x2), the
fragment registers each lane hands to mma.sync, the p transpose through shared memory, the bias
shuffles and the split/warp/tail scheduling. mma.sync itself is modelled from the PTX ISA's
m16n8k16 fragment layout (which lane holds which element), products exact, sums in float64. What
it cannot catch: compiler or hardware behaviour (that is tests/test_cuda_cpp_kernel.py's GPU part).
Slow by design: small shapes only.

Both element types are modelled (the kernel's Num<T>): fp16, and bf16 with its own magic number
(128.0 = 0x4300), the high nibble of a byte read from the word shifted right by 4, fma.rn.bf16x2
and the bf16 MMA; each rounding is one round-to-nearest-even to the type (`Fmt.round_bits`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

WARPS, CHUNK, HEADS = 4, 32, 8


class Fmt:
    """A 16-bit float type as the kernel's Num<T> uses it."""

    def __init__(self, name, magic, shift_high, code_mul, code_add, mantissa, bias):
        self.name, self.magic, self.shift_high = name, magic, shift_high
        self.code_mul, self.code_add = code_mul, code_add
        self.mantissa, self.bias = mantissa, bias

    def magic_at(self, k: int) -> int:
        """Num<T>::magic_at: two 2^(mantissa - k), under which a code at bit k of a half reads 2^(mantissa - k) + c."""
        return ((self.bias + self.mantissa - k) << self.mantissa) * 0x00010001

    def decode(self, bits16: np.ndarray) -> np.ndarray:
        bits16 = np.asarray(bits16, dtype=np.uint16)
        if self.name == "fp16":
            return bits16.view(np.float16).astype(np.float64)
        return (bits16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def round_bits(self, x) -> np.ndarray:
        """float64 -> the type's bits, one round to nearest even. bf16: |x| < 2^-126 becomes 0 (the
        kernel's p comes from ex2.approx.ftz, its other operands are never that small)."""
        x = np.asarray(x, dtype=np.float64)
        if self.name == "fp16":
            return x.astype(np.float16).view(np.uint16)
        m, e = np.frexp(np.where(np.abs(x) < 2.0**-126, 0.0, x))
        r = np.ldexp(np.round(m * 256), e - 8)  # 8 significant bits, ties to even
        return (r.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


FP16 = Fmt("fp16", 0x64006400, False, (0x3C003C00, 0x34003400, 0x2C002C00, 0x24002400),
           (0xE400E400, 0xDC00DC00, 0xD400D400, 0xCC00CC00), 10, 15)
# bf16 128.0; 128 + 4^i c -> c for i < 2 (a byte's high nibble is shifted down first)
BF16 = Fmt("bf16", 0x43004300, True, (0x3F803F80, 0x3E803E80), (0xC300C300, 0xC200C200), 7, 127)


def fmt_of(dtype: torch.dtype) -> Fmt:
    return BF16 if dtype == torch.bfloat16 else FP16


def h2(bits: int, num: Fmt = FP16) -> np.ndarray:
    """The two halves (low, high) of a 32-bit register, as float64."""
    return num.decode([bits & 0xFFFF, (bits >> 16) & 0xFFFF])


def pack(lo: float, hi: float, num: Fmt = FP16) -> int:
    """Two fp32 values (the kernel's floats) rounded to the type (nearest even) packed as a register."""
    b = num.round_bits(np.array([lo, hi], dtype=np.float32).astype(np.float64))
    return int(b[0]) | int(b[1]) << 16


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def magic(x: int, mask: int, num: Fmt = FP16) -> int:
    return (x & mask) | num.magic


def hfma2(a: int, b: int, c: int, num: Fmt = FP16) -> int:
    r = h2(a, num) * h2(b, num) + h2(c, num)  # exact in float64 for these operands, then one rounding
    bits = num.round_bits(r)
    return int(bits[0]) | int(bits[1]) << 16


def sub2(a: int, b: int, num: Fmt = FP16) -> int:
    """Num<T>::sub2: a - b per half, one rounding (fp16 sub.rn.f16x2; bf16 a * 1 - b by fma.rn.bf16x2)."""
    bits = num.round_bits(h2(a, num) - h2(b, num))
    return int(bits[0]) | int(bits[1]) << 16


def codes_at(x: int, bits: int, i: int, num: Fmt = FP16, magic_codes: bool = False) -> int:
    """The position-i codes of bytes 0 and 2 (kernel: codes_at<T, B, I>); bf16 takes a byte's high
    nibble (bits * i >= 4) from x >> 4. magic_codes (KIVI_DECODE_FOLD16 = 2): the position's own
    magic, then one subtraction of it."""
    if num.shift_high and bits * i >= 4:
        x, i = x >> 4, i - 4 // bits
    mask = ((1 << bits) - 1) * 0x00010001 << (bits * i)
    if magic_codes:
        m = num.magic_at(bits * i)
        return sub2((x & mask) | m, m, num)
    return hfma2(magic(x, mask, num), num.code_mul[bits * i // 2], num.code_add[bits * i // 2], num)


def key_magic(KB: int, y: bool, num: Fmt) -> int:
    """key_magic<KB, T>(y): the halves' magic of a0, a1 (y: a2, a3) in magic form."""
    lo = 0 if num.shift_high or KB == 4 or not y else 4
    hi = (2 if KB == 2 else 0) if num.shift_high else 4 if KB == 4 else lo + 2
    return (num.magic_at(lo) & 0xFFFF) | (num.magic_at(hi) & 0xFFFF0000)


def k_fragment_magic(w0: int, w1: int, s: int, KB: int, num: Fmt) -> tuple:
    """key_codes<KB, T, true>: the fragment as k_fragment's lop3 inputs OR-ed with key_magic, no fma2."""
    if KB == 2:
        sel = (s % 4) * 0x0101
        x0, x1 = prmt(w0, 0, sel), prmt(w1, 0, sel)
        if num.shift_high:
            y0, y1, mask_y = prmt(w0 >> 4, 0, sel), prmt(w1 >> 4, 0, sel), 0x000C0003
        else:
            y0, y1, mask_y = x0, x1, 0x00C00030
        mx, my = key_magic(KB, False, num), key_magic(KB, True, num)
        return ((x0 & 0x000C0003) | mx, (x1 & 0x000C0003) | mx, (y0 & mask_y) | my, (y1 & mask_y) | my)
    lo, hi = 2 * (s % 2), 2 * (s % 2) + 1
    if num.shift_high:
        xs, mask = [prmt(w, w >> 4, b | (4 + b) << 8) for b in (lo, hi) for w in (w0, w1)], 0x000F000F
    else:
        xs, mask = (prmt(w0, 0, lo * 0x0101), prmt(w1, 0, lo * 0x0101), prmt(w0, 0, hi * 0x0101),
                    prmt(w1, 0, hi * 0x0101)), 0x00F0000F
    m = key_magic(KB, False, num)
    return tuple((x & mask) | m for x in xs)


def k_fragment(w0: int, w1: int, s: int, KB: int, num: Fmt) -> tuple:
    """The key A fragment (a0..a3) of k-step s from a lane's words of rows g (w0) and g + 8 (w1)."""
    if KB == 2:
        sel = (s % 4) * 0x0101
        x0, x1 = prmt(w0, 0, sel), prmt(w1, 0, sel)
        if num.shift_high:  # codes 2 and 3 from the words shifted by 4, where codes 0 and 1 sit
            y0, y1 = prmt(w0 >> 4, 0, sel), prmt(w1 >> 4, 0, sel)
            return tuple(hfma2(magic(x, 0x000C0003, num), 0x3E803F80, 0xC200C300, num) for x in (x0, x1, y0, y1))
        return (hfma2(magic(x0, 0x000C0003), 0x34003C00, 0xDC00E400),
                hfma2(magic(x1, 0x000C0003), 0x34003C00, 0xDC00E400),
                hfma2(magic(x0, 0x00C00030), 0x24002C00, 0xCC00D400),
                hfma2(magic(x1, 0x00C00030), 0x24002C00, 0xCC00D400))
    lo = 2 * (s % 2)
    hi = lo + 1
    if num.shift_high:  # byte b into byte 0, byte b of the word shifted by 4 into byte 2
        xs = [prmt(w, w >> 4, b | (4 + b) << 8) for b in (lo, hi) for w in (w0, w1)]
        return tuple(hfma2(magic(x, 0x000F000F, num), 0x3F803F80, 0xC300C300, num) for x in xs)
    xs = (prmt(w0, 0, lo * 0x0101), prmt(w1, 0, lo * 0x0101), prmt(w0, 0, hi * 0x0101), prmt(w1, 0, hi * 0x0101))
    return tuple(hfma2(magic(x, 0x00F0000F), 0x2C003C00, 0xD400E400) for x in xs)


def mma(c, a, b, num: Fmt = FP16):
    """c[lane] (4 fp32) += A . B for one warp's fragments a[lane] (4 regs), b[lane] (2 regs)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = h2(a[lane][0], num), h2(a[lane][1], num)
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = h2(a[lane][2], num), h2(a[lane][3], num)
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = h2(b[lane][0], num), h2(b[lane][1], num)
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


class Variant(NamedTuple):
    """decode_attend.cu's compile-time variant: KIVI_DECODE_STAGES, KIVI_DECODE_RESIDUAL_IN_LOOP and
    KIVI_DECODE_FOLD16 (fold16: 1 or 2; magic: 2, the codes in magic form)."""
    stages: int = 1
    residual_in_loop: bool = False
    fold16: bool = False
    magic: bool = False


RING_LIMIT = 64 * 1024  # kRingLimit


def stage_layout(D, KB, VB):
    """Stage<D, KB, VB>: (offsets of key codes, value codes, key scales, key zeros, value scales, value
    zeros, total bytes)."""
    keys, values, kscales, vscales = CHUNK * D * KB // 8, CHUNK * D * VB // 8, 2 * D, CHUNK * 2 * (D // 32)
    offsets = np.cumsum([0, keys, values, kscales, kscales, vscales, vscales])
    return tuple(int(o) for o in offsets)


def stages_built(stages, D, KB, VB):
    """Stage::kStagesBuilt: the asked stages, halved while the block's ring would pass 64 KB."""
    total = stage_layout(D, KB, VB)[-1]
    return 4 if stages == 4 and 4 * WARPS * total <= RING_LIMIT else 2 if stages >= 2 and 2 * WARPS * total <= RING_LIMIT else 1


def global_source(flat, rows, t0, ngv, num):
    """A chunk's data as global_source addresses it: 32 code rows from the chunk's first row, its key
    group's scale and zero rows, 32 x ngv value scales and zeros (16-bit bits for the scales)."""
    kc, ks, kz, vc, vs, vz = flat
    r0, kg = rows(t0)
    return dict(kc=kc[r0:r0 + CHUNK], vc=vc[r0:r0 + CHUNK], ks=num.round_bits(ks[kg]), kz=num.round_bits(kz[kg]),
                vs=num.round_bits(vs[r0:r0 + CHUNK]).reshape(-1), vz=num.round_bits(vz[r0:r0 + CHUNK]).reshape(-1))


def issue_stage(src, D, KB, VB, ngv):
    """The stage bytes issue_stage leaves in shared memory: each part copied by the warp in 16-byte
    pieces (lane's piece 16 lane + 512 k, the value scales only up to 64 ngv bytes)."""
    o = stage_layout(D, KB, VB)
    stage = np.full(o[-1], 0xEE, dtype=np.uint8)  # never-written bytes show as garbage
    parts = [src["kc"].reshape(-1), src["vc"].reshape(-1), src["ks"].view(np.uint8), src["kz"].view(np.uint8),
             src["vs"].view(np.uint8), src["vz"].view(np.uint8)]
    for j, part in enumerate(parts):
        size, copied = o[j + 1] - o[j], (CHUNK * 2 * ngv if j >= 4 else None)
        for lane in range(32):
            for k in range(-(-size // 512)):
                i = 16 * lane + 512 * k
                if i < (size if copied is None else copied):
                    stage[o[j] + i:o[j] + i + 16] = part[i:i + 16]
    return stage


def stage_source(stage, D, KB, VB, ngv):
    o = stage_layout(D, KB, VB)
    return dict(kc=stage[o[0]:o[1]].reshape(CHUNK, -1), vc=stage[o[1]:o[2]].reshape(CHUNK, -1),
                ks=stage[o[2]:o[3]].view(np.uint16), kz=stage[o[3]:o[4]].view(np.uint16),
                vs=stage[o[4]:o[5]].view(np.uint16)[:CHUNK * ngv], vz=stage[o[5]:o[6]].view(np.uint16)[:CHUNK * ngv])


def ring_schedule(chunks, stages):
    """The order warp_chunks' ring runs: ('issue', chunk, slot) and ('compute', chunk, slot) events."""
    if stages == 1:
        return [("compute", c, None) for c in chunks]
    events = [("issue", chunks[i], i) for i in range(stages - 1) if i < len(chunks)]
    for i, c in enumerate(chunks):
        if i + stages - 1 < len(chunks):
            events.append(("issue", chunks[i + stages - 1], (i + stages - 1) % stages))
        events.append(("compute", c, i % stages))
    return events


class WarpState:
    def __init__(self, MT):
        self.acc = [[[0.0] * 4 for _ in range(MT)] for _ in range(32)]
        self.m = [[-math.inf, -math.inf] for _ in range(32)]
        self.l = [[0.0, 0.0] for _ in range(32)]


def online_softmax(sc, bias, st, MT):
    """online_softmax: p per lane into the transpose buffer, m, l and acc rescaled."""
    mx = [[max(sc[0][lane][j], sc[0][lane][j + 2], sc[1][lane][j], sc[1][lane][j + 2]) + bias[lane][j]
           for j in range(2)] for lane in range(32)]
    for off in (4, 8, 16):
        mx = [[max(mx[lane][j], mx[lane ^ off][j]) for j in range(2)] for lane in range(32)]
    p_s = np.zeros((HEADS, 36))
    for lane in range(32):
        g, tig = lane // 4, lane % 4
        n = [max(st.m[lane][j], mx[lane][j]) for j in range(2)]
        al = [2.0 ** (st.m[lane][j] - n[j]) if st.m[lane][j] != -math.inf else 0.0 for j in range(2)]
        st.m[lane] = n
        st.l[lane] = [st.l[lane][j] * al[j] for j in range(2)]
        for mt in range(2):
            p = [2.0 ** (sc[mt][lane][k] + bias[lane][k % 2] - n[k % 2]) for k in range(4)]
            st.l[lane][0] += p[0] + p[2]
            st.l[lane][1] += p[1] + p[3]
            p_s[2 * tig, 16 * mt + g], p_s[2 * tig + 1, 16 * mt + g] = p[0], p[1]
            p_s[2 * tig, 16 * mt + g + 8], p_s[2 * tig + 1, 16 * mt + g + 8] = p[2], p[3]
        for mt in range(MT):
            st.acc[lane][mt] = [st.acc[lane][mt][k] * al[k % 2] for k in range(4)]
    return p_s


def value_fragments(w, S01, S23, Z01, Z23, D, VB, num, magic_codes=False):
    """value_fragments: a[mt] (4 registers) of one lane from its 4 tokens' words and scale pairs."""
    VBPT, MT = D * VB // 64, D // 16
    a = [None] * MT
    for j in range(VBPT):
        sel = (j % 4) | ((4 + j % 4) << 8)
        x01, x23 = prmt(w[0][j // 4], w[1][j // 4], sel), prmt(w[2][j // 4], w[3][j // 4], sel)
        # VB = 2: m-tiles 2j, 2j + 1 hold codes (0, 1), (2, 3) of byte j; VB = 4: m-tile j its nibbles
        tiles = 2 if VB == 2 else 1
        for half in range(tiles):
            i0, i1 = 2 * half, 2 * half + 1
            c = [codes_at(x, VB, i, num, magic_codes) for x, i in ((x01, i0), (x01, i1), (x23, i0), (x23, i1))]
            a[tiles * j + half] = [hfma2(c[0], S01, Z01, num), hfma2(c[1], S01, Z01, num),
                                   hfma2(c[2], S23, Z23, num), hfma2(c[3], S23, Z23, num)]
    return a


def value_words(row, g, VBPT):
    return [word(row, g * VBPT + 4 * i, min(VBPT, 4)) for i in range(max(VBPT // 4, 1))]


def q16_slot(ch: int) -> int:
    """decode_attend.cu's q16_slot: in each 8 channels of the 16-bit query copy the pairs 01 45 23 67."""
    return (ch & ~6) | (ch & 2) << 1 | (ch & 4) >> 1


def magic_bias(q_s, src, qk, D, KB, num):
    """quantized_chunk's bias under KIVI_DECODE_FOLD16 = 2, per lane (rows g, g + 8 x heads): per two
    k-steps the zeros z01 z23 z45 z67 as A against (q01, q45) into acc (row g kept) and (q23, q67) into
    acc8 (row g + 8 kept), then - q' . M for both k-steps into acc; the bias is acc + acc8 in fp32."""
    q16 = np.zeros((HEADS, D), dtype=np.uint16)
    for ch in range(D):
        q16[:, q16_slot(ch)] = num.round_bits(q_s[:, ch])
    mx, my = key_magic(KB, False, num) | 0x80008000, key_magic(KB, True, num) | 0x80008000
    acc, acc8 = [[0.0] * 4 for _ in range(32)], [[0.0] * 4 for _ in range(32)]
    for s in range(0, D // 16, 2):
        z, q = [], []
        for lane in range(32):
            c0 = k_channel(D, KB, s, lane % 4, 0)
            zb, qb = src["kz"][c0:c0 + 8], q16[lane // 4, c0:c0 + 8]
            z.append(tuple(int(zb[2 * i]) | int(zb[2 * i + 1]) << 16 for i in range(4)))
            q.append(tuple(int(qb[2 * i]) | int(qb[2 * i + 1]) << 16 for i in range(4)))  # q01 q45 q23 q67
        mma(acc, z, [(x[0], x[1]) for x in q], num)
        mma(acc8, z, [(x[2], x[3]) for x in q], num)
        for k in (s, s + 1):
            mma(acc, [(mx, 0, my, 1)] * 32, [qk[lane][k] for lane in range(32)], num)  # rows g + 8: 0 and 1, unused
    out = []
    for lane in range(32):
        b0, b1 = float(np.float32(acc[lane][0] + acc8[lane][2])), float(np.float32(acc[lane][1] + acc8[lane][3]))
        out.append([b0, b1, b0, b1])
    return out


def quantized_chunk(q_s, src, ngv, D, G, KB, VB, st, num, fold16=False, magic_codes=False):
    """quantized_chunk: one fully quantized chunk from `src` (global_source or stage_source).
    magic_codes (KIVI_DECODE_FOLD16 = 2): the 16-bit fold with the key codes in magic form and the
    scores starting at the group's bias (q16 . z, then - q' . M, per k-step)."""
    KROW, VROW, KS, MT = D * KB // 8, D * VB // 8, D // 16, D // 16
    KWPT, VBPT, Gv = KROW // 16, VROW // 8, min(G, D)
    ks, kz = num.decode(src["ks"]), num.decode(src["kz"])
    qk, zdot = [[None] * KS for _ in range(32)], [0.0] * 32
    for lane in range(32):
        g, tig = lane // 4, lane % 4
        for s in range(KS):
            ch = k_channel(D, KB, s, tig, 0)
            qv = q_s[g, ch:ch + 4]
            sv, zv = ks[ch:ch + 4], kz[ch:ch + 4]
            qk[lane][s] = (pack(qv[0] * sv[0], qv[1] * sv[1], num), pack(qv[2] * sv[2], qv[3] * sv[3], num))
            zdot[lane] = float(np.float32(zdot[lane] + np.float32((qv * zv).sum())))
    zdot = [zdot[lane] + zdot[lane ^ 1] for lane in range(32)]
    zdot = [zdot[lane] + zdot[lane ^ 2] for lane in range(32)]
    bias = [(zdot[8 * (lane % 4)], zdot[8 * (lane % 4) + 4]) for lane in range(32)]
    sc0 = [[0.0] * 4 for _ in range(32)]  # the scores' start
    if fold16:  # q16 * s by one fma2 (+ -0), q16 . z by one MMA per k-step with z as every row of A
        zsc = [[0.0] * 4 for _ in range(32)]
        for s in range(KS):
            qf, zf = [], []
            for lane in range(32):
                g, tig = lane // 4, lane % 4
                ch = k_channel(D, KB, s, tig, 0)
                qv = q_s[g, ch:ch + 4]
                q01, q23 = pack(qv[0], qv[1], num), pack(qv[2], qv[3], num)
                sb, zb = src["ks"][ch:ch + 4], src["kz"][ch:ch + 4]
                sx, sy = int(sb[0]) | int(sb[1]) << 16, int(sb[2]) | int(sb[3]) << 16
                zx, zy = int(zb[0]) | int(zb[1]) << 16, int(zb[2]) | int(zb[3]) << 16
                qk[lane][s] = (hfma2(q01, sx, 0x80008000, num), hfma2(q23, sy, 0x80008000, num))
                qf.append((q01, q23))
                zf.append((zx, zx, zy, zy))
            mma(zsc, zf, qf, num)
        bias = [(zsc[lane][0], zsc[lane][1]) for lane in range(32)]
        if magic_codes:
            sc0, bias = magic_bias(q_s, src, qk, D, KB, num), [(0.0, 0.0)] * 32
    sc = [[list(sc0[lane]) for lane in range(32)] for _ in range(2)]
    for mt in range(2):
        words = []
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            words.append([[word(src["kc"][16 * mt + g + 8 * r], 4 * KWPT * tig + 4 * i, 4) for i in range(KWPT)]
                          for r in range(2)])
        for s in range(KS):
            i = s // 4 if KB == 2 else s // 2  # the word of k-step s
            frag = k_fragment_magic if magic_codes else k_fragment
            a = [frag(words[lane][0][i], words[lane][1][i], s, KB, num) for lane in range(32)]
            mma(sc[mt], a, [qk[lane][s] for lane in range(32)], num)
    p_s = online_softmax(sc, bias, st, MT)
    for kstep in range(2):
        a_regs, b = [], []
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            pv = p_s[g, 16 * kstep + 4 * tig:16 * kstep + 4 * tig + 4]
            b.append((pack(pv[0], pv[1], num), pack(pv[2], pv[3], num)))
            t = 16 * kstep + 4 * tig  # a row of the chunk
            w = [value_words(src["vc"][t + e], g, VBPT) for e in range(4)]
            vg = g * (D // 8) // Gv
            sh = [int(src["vs"][(t + e) * ngv + vg]) for e in range(4)]
            zh = [int(src["vz"][(t + e) * ngv + vg]) for e in range(4)]
            a_regs.append(value_fragments(w, sh[0] | sh[1] << 16, sh[2] | sh[3] << 16, zh[0] | zh[1] << 16,
                                          zh[2] | zh[3] << 16, D, VB, num, magic_codes))
        for mt in range(MT):
            cm = [st.acc[lane][mt] for lane in range(32)]
            mma(cm, [a_regs[lane][mt] for lane in range(32)], b, num)
    # (the kernel's __syncwarp()s order the p_s writes and reads; sequential here)


def token_source(t, quantized, length):
    """Where mixed_chunk reads token t's key (quantized = nqk) or value (nqv): 'codes', 'residual' or None."""
    return "codes" if t < quantized else "residual" if t < length else None


def half_bits(x, num):
    """A row of 16-bit values (float64) as their bits."""
    return [int(v) for v in num.round_bits(x)]


def mixed_chunk(q_s, flat, rows, kres, vres, t0, rc, ngv, D, G, KB, VB, st, num, magic_codes=False):
    """mixed_chunk: tokens [t0, t0 + 32), keys and values each quantized, residual or none."""
    L, nqk, nqv = rc
    KROW, VROW, KS, MT = D * KB // 8, D * VB // 8, D // 16, D // 16
    KWPT, VBPT, Gv, W = KROW // 16, VROW // 8, min(G, D), kres.shape[0]
    src = global_source(flat, rows, t0, ngv, num)  # the kernel's too: only what a token's source is, is used
    r0 = rows(t0)[0]
    kc, vc = flat[0], flat[3]
    ks, kz = src["ks"], src["kz"]
    kres_b, vres_b = num.round_bits(kres), num.round_bits(vres)
    pick = lambda a, b, sel: prmt(a, b, sel)  # noqa: E731
    sc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
    for mt in range(2):
        frags, qf = [[] for _ in range(KS)], [[] for _ in range(KS)]
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            toks = [t0 + 16 * mt + g + 8 * r for r in range(2)]
            quant = [token_source(t, nqk, L) == "codes" for t in toks]
            w = [[word(kc[r0 + 16 * mt + g + 8 * r], 4 * KWPT * tig + 4 * i, 4) if quant[r] else 0 for i in range(KWPT)]
                 for r in range(2)]
            for s in range(KS):
                ch = k_channel(D, KB, s, tig, 0)
                i = s // 4 if KB == 2 else s // 2
                a = list(k_fragment(w[0][i], w[1][i], s, KB, num))
                sx, sy = int(ks[ch]) | int(ks[ch + 1]) << 16, int(ks[ch + 2]) | int(ks[ch + 3]) << 16
                zx, zy = int(kz[ch]) | int(kz[ch + 1]) << 16, int(kz[ch + 2]) | int(kz[ch + 3]) << 16
                res = []
                for r, t in enumerate(toks):
                    if token_source(t, nqk, L) == "residual":
                        row = kres_b[t % W]
                        res.append((int(row[ch]) | int(row[ch + 1]) << 16, int(row[ch + 2]) | int(row[ch + 3]) << 16))
                    else:
                        res.append((0, 0))
                a[0] = hfma2(a[0], sx, zx, num) if quant[0] else res[0][0]
                a[2] = hfma2(a[2], sy, zy, num) if quant[0] else res[0][1]
                a[1] = hfma2(a[1], sx, zx, num) if quant[1] else res[1][0]
                a[3] = hfma2(a[3], sy, zy, num) if quant[1] else res[1][1]
                frags[s].append(tuple(a))
                qv = q_s[g, ch:ch + 4]
                qf[s].append((pack(qv[0], qv[1], num), pack(qv[2], qv[3], num)))
        for s in range(KS):
            mma(sc[mt], frags[s], qf[s], num)
        for lane in range(32):
            g = lane // 4
            if t0 + 16 * mt + g >= L:
                sc[mt][lane][0] = sc[mt][lane][1] = -math.inf
            if t0 + 16 * mt + g + 8 >= L:
                sc[mt][lane][2] = sc[mt][lane][3] = -math.inf
    p_s = online_softmax(sc, [(0.0, 0.0)] * 32, st, MT)
    for kstep in range(2):
        a_regs, b = [], []
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            pv = p_s[g, 16 * kstep + 4 * tig:16 * kstep + 4 * tig + 4]
            b.append((pack(pv[0], pv[1], num), pack(pv[2], pv[3], num)))
            t = 16 * kstep + 4 * tig
            vg = g * (D // 8) // Gv
            w, sh, zh, rv, resid = [], [], [], [], []
            for e in range(4):
                tok = t0 + t + e
                quant = token_source(tok, nqv, L) == "codes"
                resid.append(token_source(tok, nqv, L) == "residual")
                row = r0 + t + e
                w.append(value_words(vc[row], g, VBPT) if quant else [0] * max(VBPT // 4, 1))
                sh.append(half_bits(flat[4][row, vg:vg + 1], num)[0] if quant else 0)
                zh.append(half_bits(flat[5][row, vg:vg + 1], num)[0] if quant else 0)
                rv.append([int(x) for x in vres_b[tok % W, g * (D // 8):(g + 1) * (D // 8)]] if resid[-1]
                          else [0] * (D // 8))
            a = value_fragments(w, sh[0] | sh[1] << 16, sh[2] | sh[3] << 16, zh[0] | zh[1] << 16, zh[2] | zh[3] << 16,
                                D, VB, num, magic_codes)
            pick01 = (0x0054 if resid[0] else 0x0010) | (0x7600 if resid[1] else 0x3200)
            pick23 = (0x0054 if resid[2] else 0x0010) | (0x7600 if resid[3] else 0x3200)
            for mt in range(MT):
                for r in range(4):
                    c = v_channel(D, VB, mt, 0, r & 1)  # the channel within the lane group's D / 8
                    e0 = 2 * (r >> 1)
                    words = [rv[e][c // 2 * 2] | rv[e][c // 2 * 2 + 1] << 16 for e in (e0, e0 + 1)]
                    pair = prmt(words[0], words[1], 0x7632 if c % 2 else 0x5410)
                    a[mt][r] = pick(a[mt][r], pair, pick23 if r >> 1 else pick01)
            a_regs.append(a)
        for mt in range(MT):
            cm = [st.acc[lane][mt] for lane in range(32)]
            mma(cm, [a_regs[lane][mt] for lane in range(32)], b, num)


def warp_chunks(q_s, flat, rows, kres, vres, chunks, c_quant, rc, D, G, KB, VB, num, variant):
    """warp_chunks: one warp's chunks (its arithmetic progression), the quantized ones through the
    stage ring when the variant has one, then the mixed ones. Returns (m, l, acc) per head in fp32."""
    MT, ngv = D // 16, D // min(G, D)
    st = WarpState(MT)
    quantized = [c for c in chunks if c < c_quant]
    S = stages_built(variant.stages, D, KB, VB)
    ring = [np.full(stage_layout(D, KB, VB)[-1], 0xEE, dtype=np.uint8)] * S  # shared memory never written: garbage
    for event, c, slot in ring_schedule(quantized, S):
        src = global_source(flat, rows, c * CHUNK, ngv, num)
        if event == "issue":
            ring[slot] = issue_stage(src, D, KB, VB, ngv)
        else:
            quantized_chunk(q_s, src if slot is None else stage_source(ring[slot], D, KB, VB, ngv), ngv, D, G, KB, VB,
                            st, num, variant.fold16, variant.magic)
    if variant.residual_in_loop:
        for c in chunks:
            if c >= c_quant:
                mixed_chunk(q_s, flat, rows, kres, vres, c * CHUNK, rc, ngv, D, G, KB, VB, st, num, variant.magic)
    for off in (4, 8, 16):
        st.l = [[st.l[lane][j] + st.l[lane ^ off][j] for j in range(2)] for lane in range(32)]
    out_m, out_l, out_acc = np.full(HEADS, -math.inf), np.zeros(HEADS), np.zeros((HEADS, D))
    for lane in range(32):
        g, tig = lane // 4, lane % 4
        for mt in range(MT):
            ch = v_channel(D, VB, mt, g, 0)
            out_acc[2 * tig, ch], out_acc[2 * tig + 1, ch] = st.acc[lane][mt][0], st.acc[lane][mt][1]
            out_acc[2 * tig, ch + 1], out_acc[2 * tig + 1, ch + 1] = st.acc[lane][mt][2], st.acc[lane][mt][3]
        if g == 0:
            out_m[2 * tig:2 * tig + 2], out_l[2 * tig:2 * tig + 2] = st.m[lane], st.l[lane]
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


def emulate_decode(query, layer, counts, params, scale, num_splits, pages=None, variant=Variant()):
    """decode_attend.cu's output for query [B, Hq, 1, D] over a 2/4-bit fp16 or bf16 layer on CPU (in
    the layer's dtype), as built with `variant`; pages (a paged_layout.Paging): the layer is paged,
    read through its block table."""
    num = fmt_of(layer.k_res.dtype)
    # numpy has no bf16: its values as float64 (exact)
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = (
        (t.double() if t.dtype == torch.bfloat16 else t).numpy() for t in layer.kivi)
    B, Hq, _, D = query.shape
    H = k_codes.shape[1]
    KB, VB = k_codes.shape[-1] * 8 // D, v_codes.shape[-1] * 8 // D
    if pages is None:
        S, paging = k_codes.shape[2], {}
    else:
        S = pages.capacity
        paging = dict(table=pages.block_table.numpy(), page_size=k_codes.shape[2], num_pages=k_codes.shape[0])
    flat = [x.reshape(-1, x.shape[-1]) for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)]
    qg, G, R = Hq // H, params.group_size, params.residual_length
    out = np.zeros((B, Hq, D))
    for b in range(B):
        L = int(lengths[b]) if counts is None or int(counts[b]) != 0 else 0
        if params.flush_policy:
            nqk = nqv = max(L - R, 0) // G * G
        else:
            nqk, nqv = L // R * R, max(L - R, 0)
        c_quant = min(nqk, nqv) // CHUNK
        chunks = -(-L // CHUNK) if variant.residual_in_loop else c_quant  # what the splits share
        per = -(-chunks // num_splits)
        for h, head0 in ((h, head0) for h in range(H) for head0 in range(0, qg, HEADS)):  # the blocks' tiles
            heads = min(HEADS, qg - head0)
            first = h * qg + head0  # the tile's first query head
            q_s = np.zeros((HEADS, D))
            q_s[:heads] = query[b, first:first + heads, 0].double().numpy() * np.float32(scale * 1.4426950408889634)
            q_s = q_s.astype(np.float32).astype(np.float64)
            splits = []
            rows = Rows(b, h, H, S, G, **paging)
            for split in range(num_splits):
                begin, end = split * per, min(split * per + per, chunks)
                splits.append(merge([warp_chunks(q_s, flat, rows, k_res[b, h], v_res[b, h], range(begin + w, end, WARPS),
                                                 c_quant, (L, nqk, nqv), D, G, KB, VB, num, variant)
                                     for w in range(WARPS)]))
            if not variant.residual_in_loop:
                kc, ks, kz, vc, vs, vz = flat
                splits.append(merge([tail_tokens(q_s, kc, ks, kz, k_res[b, h], vc, vs, vz, v_res[b, h], rows,
                                                 range(c_quant * CHUNK + w, L, WARPS), nqk, nqv, heads, D, G)
                                     for w in range(WARPS)]))
            M, l_, acc = merge(splits)
            o = np.where(l_[:, None] > 0, acc / np.where(l_ > 0, l_, 1)[:, None], 0.0)
            out[b, first:first + heads] = np.clip(o[:heads], -65504, 65504) if num is FP16 else o[:heads]
    # the merge kernel's fp32 quotient, rounded to the type
    return torch.from_numpy(out.astype(np.float32)).to(layer.k_res.dtype).reshape(B, Hq, 1, D)
