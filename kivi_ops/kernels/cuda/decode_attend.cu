// KIVI decode attention (one query token per row; 2- or 4-bit keys and values, each its own width)
// on tensor cores, for sm_80+ (built for sm_90a).
//
// The math is kernels/reference.py's attend_reference; the layout is kivi_ops/layout.py's, or a
// paged layer's (paged_layout.py: the code and scale rows through the block table). Grid
// (B * H * ceil(qg / 8), num_splits + 1), 4 warps per block (one block per 8 query heads: up to 16
// query heads per kv head in two tiles). Splits [0, num_splits) share the fully quantized
// 32-token chunks [0, 32 * floor(min(nqk, nqv) / 32)) of the row; split num_splits (the "tail")
// takes the rest, at most R + 31 tokens (quantized, residual or mixed), in fp32 on CUDA cores. A
// second kernel merges the splits' (max, sum, unnormalized output) into the output (fp16 or bf16).
//
// The cache's 16-bit type T (fp16 or bf16: scales, zeros, residuals, query, output) is a template
// parameter; below, "fp16" is T for an fp16 cache, and Num<T> says what changes for bf16.
//
// Quantized chunks: each warp takes whole chunks (one key group when G = 32; G must be a multiple
// of 32) and runs mma.sync m16n8k16 (fp16 in, fp32 accumulate) with the KV tokens in the M
// dimension and 8 query heads of the kv head in N (TurboMind's swap: a decode query is
// one row, tokens fill the tile):
//   scores^T [16 tokens, 8 heads] = codes_K [16 tokens, D] . q'^T [D, 8 heads] + q . z (per group)
//     where q' = q * k_scale (per channel of the group, in fp16): KIVI's key fold, so the key
//     codes enter the MMA as exact small integers and the zero point costs one dot per group.
//   out^T [D, 8 heads] += V^T [D, 16 tokens] . p [16 tokens, 8 heads], V = v_scale * code + v_zero
//     dequantized to fp16 in registers (one rounding; v's scale and zero vary per token, so they
//     cannot fold into p for a tile whose rows span value groups).
// Unpacking: a B-bit code c at bit B i of a byte is moved by one prmt (byte select) and one lop3
// ((x & mask) | 0x6400) into the mantissa of 1024.0 as 1024 + 2^(B i) c, and one fma.f16x2 by
// (2^-(B i), -1024 * 2^-(B i)) gives c exactly; no integer-to-float conversion instruction is issued.
// Key and value widths are template parameters (KB, VB): each instantiation unpacks one width.
// The MMA's k index (channels for K, tokens for V) and the rows of V^T are permuted so that each
// thread reads whole bytes of the layout as stored: the query fragment and the output rows use the
// same permutation (k_channel / v_channel below), nothing is repacked.
// bf16: the magic number is 128.0 (0x4300: 7 mantissa bits, ulp 1 on [128, 256)), so a code must
// stay below 128 in the mantissa: a byte's high nibble (2-bit codes 2 and 3, the 4-bit high code)
// is read from the word shifted right by 4, one shift per word or register, and every unpacked
// value is 128 + 4^i c with i <= 1 (at most 140). fma.rn.bf16x2 and the bf16 m16n8k16 MMA (fp32
// accumulate) replace the fp16 ones; the k and token permutations are the same.
//
// Numerics against the fp32 reference (tests/test_cuda_cpp_kernel.py checks this bound): q' is
// rounded to fp16 (relative 2^-11 per term, so a base-2 score is off by at most
// (2^KB - 1) * 2^-11 * sum_c |q'_c|), V is dequantized to fp16 (2^-11 |v|), p is rounded to fp16 for the
// PV product (2^-11), accumulations are fp32; tail tokens are fp32 throughout. bf16: the same three
// roundings at bf16's 2^-8 (8 significant bits) in place of 2^-11; the codes stay exact.
// KIVI_DECODE_FOLD16 = 2 adds the fp32 cancellation of the magic offsets: each MMA of a score's chain
// (the bias' and the key MMAs) holds at most (2 M + 2^KB - 1) sum_c |q'_c| (M = 1024, bf16 128), so a
// score is off by at most a further (2 D / 16 + 2) 2^-23 of that (tests' magic_score_error).
#include "decode_attend.h"

#include <cstddef>

namespace kivi_cuda {
// prebuilt.py mirrors DecodeParams with ctypes: keep the two layouts equal.
static_assert(sizeof(DecodeParams) == 192 && offsetof(DecodeParams, batch) == 120 &&
                  offsetof(DecodeParams, qscale) == 180 && offsetof(DecodeParams, bf16) == 184,
              "DecodeParams changed: update kivi_ops/kernels/cuda/prebuilt.py");
namespace {

constexpr int kWarps = 4;
constexpr int kChunk = 32;   // tokens per warp step (two 16-token MMA tiles)
constexpr int kHeads = 8;    // query heads per kv head: the MMA's N
constexpr int kPStride = 36; // p transpose buffer row stride (floats): conflict-free stores, 16-byte rows

// Compile-time variants (lab/cuda_decode_variants.py builds, counts and prices each; the GPU suite
// times them side by side). Unset: the kernel as it has been measured.
//   KIVI_DECODE_STAGES = 1, 2, 4: quantized chunks a warp keeps in flight through a cp.async ring
//     in shared memory (1: direct register loads).
//   KIVI_DECODE_RESIDUAL_IN_LOOP = 1: the chunk loop walks the rest of the row too (the residual
//     window and the partly quantized chunks as 16-bit MMA chunks, spread over the splits); no tail block.
//   KIVI_DECODE_BLOCKS_PER_SM: the split count attend.py sizes the grid for (kivi_decode_variant).
//   KIVI_DECODE_FOLD16 = 1: the key fold in 16 bits: q' = q16 * k_scale by one fma2 per channel pair
//     (q rounded to 16 bits first: two roundings), and the zero dot q16 . z by one MMA per k-step
//     with the zeros as every token row of A (the bias lands in each lane's own accumulator: no
//     conversions, no shuffles).
//   KIVI_DECODE_FOLD16 = 2: that fold, and the key codes enter the MMA in magic form: code c at bit k
//     of a 16-bit half is OR-ed into the mantissa of M = 2^(mantissa bits - k) (one lop3: M + c
//     exactly, no fma2), so q'.(M + c) = q'.c + q'.M and the accumulator starts at the group's bias
//     q16 . z - q' . M (a second MMA per k-step, A the constant -M per k index). q16 comes from a
//     16-bit copy of the query made once per block (no per-chunk converts). Numerics: as 1, but each
//     key MMA sums terms up to q' (M + c), M <= 1024 (bf16: 128), and cancels them in fp32.
#ifndef KIVI_DECODE_STAGES
#define KIVI_DECODE_STAGES 1
#endif
#ifndef KIVI_DECODE_RESIDUAL_IN_LOOP
#define KIVI_DECODE_RESIDUAL_IN_LOOP 0
#endif
#ifndef KIVI_DECODE_BLOCKS_PER_SM
#define KIVI_DECODE_BLOCKS_PER_SM 2
#endif
#ifndef KIVI_DECODE_FOLD16
#define KIVI_DECODE_FOLD16 0
#endif
static_assert(KIVI_DECODE_STAGES == 1 || KIVI_DECODE_STAGES == 2 || KIVI_DECODE_STAGES == 4,
              "KIVI_DECODE_STAGES must be 1, 2 or 4");
constexpr int kStages = KIVI_DECODE_STAGES;
constexpr bool kResidualInLoop = KIVI_DECODE_RESIDUAL_IN_LOOP != 0;
static_assert(KIVI_DECODE_FOLD16 >= 0 && KIVI_DECODE_FOLD16 <= 2, "KIVI_DECODE_FOLD16 must be 0, 1 or 2");
constexpr bool kFold16 = KIVI_DECODE_FOLD16 != 0;
constexpr bool kMagicKeys = KIVI_DECODE_FOLD16 == 2;
constexpr int kTailSplits = kResidualInLoop ? 0 : 1;  // grid columns after the quantized splits
constexpr int kRingLimit = 64 * 1024;                 // the most shared memory a block's ring takes
template <int D>
constexpr int kQ16Bytes = kMagicKeys ? kHeads * D * 2 : 0;  // the 16-bit query copy, after the ring
// where channel ch sits in that copy: in each 8 channels the pairs in the order 01 45 23 67
__host__ __device__ constexpr int q16_slot(int ch) { return (ch & ~6) | (ch & 2) << 1 | (ch & 4) >> 1; }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// (x & MASK) | MAGIC: the masked codes land in the mantissas of two 16-bit floats (fp16 1024.0 =
// 0x6400: ulp 1 up to 2047; bf16 128.0 = 0x4300: ulp 1 up to 255).
template <uint32_t MASK, uint32_t MAGIC>
__device__ __forceinline__ uint32_t magic(uint32_t x) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "n"(MASK), "n"(MAGIC));
  return d;
}

// 2^x on the MUFU unit (relative error 2^-22; 2^-inf = 0), the base of the online softmax.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t bits_of(T x) {
  return *reinterpret_cast<const uint16_t*>(&x);
}

// The cache's 16-bit float type: fp16 (__half) or bf16 (__nv_bfloat16). Each gives its magic
// number, its x2 fma (one rounding), its m16n8k16 MMA (fp32 accumulate), and the (multiplier,
// addend) pairs that turn magic + 4^i c back into c for a 2-bit position i of a byte. bf16 has 7
// mantissa bits: a code at bits 6-7 of a byte (value up to 192) would carry into the exponent of
// 128.0, so bf16 reads the high nibble of a byte from the word shifted right by 4 (SHIFT_HIGH):
// every code it unpacks is 4^i c with i <= 1 (at most 15), exact in bf16.
template <typename T>
struct Num;

template <>
struct Num<__half> {
  static constexpr uint32_t kMagic = 0x64006400u;  // two fp16 1024.0
  static constexpr bool kShiftHigh = false;
  static constexpr float kMax = 65504.f;  // outputs saturate here
  // two 2^(10 - k): a code at bit k of each half reads 2^(10 - k) + c
  __host__ __device__ static constexpr uint32_t magic_at(int k) { return ((25u - k) << 10) * 0x00010001u; }
  __device__ static uint32_t sub2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  __device__ static void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // 1024 + 4^i c -> c: multiplier 4^-i, addend -1024 * 4^-i (i < 4)
  __device__ static uint32_t code_mul(int i) {
    return i == 0 ? 0x3C003C00u : i == 1 ? 0x34003400u : i == 2 ? 0x2C002C00u : 0x24002400u;
  }
  __device__ static uint32_t code_add(int i) {
    return i == 0 ? 0xE400E400u : i == 1 ? 0xDC00DC00u : i == 2 ? 0xD400D400u : 0xCC00CC00u;
  }
};

template <>
struct Num<__nv_bfloat16> {
  static constexpr uint32_t kMagic = 0x43004300u;  // two bf16 128.0
  static constexpr bool kShiftHigh = true;
  static constexpr float kMax = 3.3895314e38f;  // bf16's largest finite value
  __host__ __device__ static constexpr uint32_t magic_at(int k) { return ((134u - k) << 7) * 0x00010001u; }  // two 2^(7 - k)
  // a - b as a * 1 - b (sub.bf16x2 needs sm_90; this builds for sm_80 too)
  __device__ static uint32_t sub2(uint32_t a, uint32_t b) { return fma2(a, 0x3F803F80u, b ^ 0x80008000u); }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  __device__ static void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // 128 + 4^i c -> c (i < 2: the high nibble is shifted down first)
  __device__ static uint32_t code_mul(int i) { return i == 0 ? 0x3F803F80u : 0x3E803E80u; }
  __device__ static uint32_t code_add(int i) { return i == 0 ? 0xC300C300u : 0xC200C200u; }
};

// The position-I B-bit codes of bytes 0 and 2 (B = 2: I < 4; B = 4: I < 2). A 4-bit code at
// position I sits where a 2-bit one at 2 I would: magic + 16^I c = magic + 4^(2I) c. bf16 takes
// the high nibble's positions (B I >= 4) from x >> 4. kMagicKeys: the magic is the position's own,
// 2^(m - B J) with m the mantissa bits (M + c), and one subtraction of M (one constant) gives c.
template <typename T, int B, int I>
__device__ __forceinline__ uint32_t codes_at(uint32_t x) {
  constexpr bool high = Num<T>::kShiftHigh && B * I >= 4;
  constexpr int J = high ? I - 4 / B : I;
  constexpr uint32_t mask = ((1u << B) - 1) * 0x00010001u << (B * J);
  if constexpr (kMagicKeys) {
    constexpr uint32_t M = Num<T>::magic_at(B * J);
    return Num<T>::sub2(magic<mask, M>(high ? x >> 4 : x), M);
  }
  return Num<T>::fma2(magic<mask, Num<T>::kMagic>(high ? x >> 4 : x), Num<T>::code_mul(B * J / 2),
                      Num<T>::code_add(B * J / 2));
}

// Key fragment mapping (D = 16 * KS channels; each of the 4 lanes of a row group reads KWPT =
// D * KB / 512 consecutive 32-bit words of a token row). MMA k index 2*tig + e is channel
// k_channel(s, tig, e), k index 2*tig + 8 + e is that + 2.
//   KB = 2: k-step s reads byte s % 4 of word tig * KWPT + s / 4 (4 channels in one byte).
//   KB = 4: k-step s reads bytes 2 (s % 2) and 2 (s % 2) + 1 of word tig * KWPT + s / 2.
template <int D, int KB>
__device__ __forceinline__ int k_channel(int s, int tig, int e) {
  if constexpr (KB == 2) {
    return 16 * (tig * (D / 64) + s / 4) + 4 * (s % 4) + e;
  } else {
    return 4 * (tig * (D / 16) + s) + e;
  }
}

// Value mapping: lane group g (row g and g + 8 of every m-tile) owns VBPT = D * VB / 64
// consecutive bytes (D / 8 channels) of each token row.
//   VB = 2: m-tile mt reads byte mt / 2; row g is code 2 * (mt % 2), row g + 8 the next.
//   VB = 4: m-tile mt reads byte mt; row g is code 0 (low nibble), row g + 8 code 1.
template <int D, int VB>
__device__ __forceinline__ int v_channel(int mt, int g, int row8) {
  constexpr int VBPT = D * VB / 64;
  if constexpr (VB == 2) {
    return 4 * (g * VBPT + mt / 2) + 2 * (mt % 2) + row8;
  } else {
    return 2 * (g * VBPT + mt) + row8;
  }
}

// N consecutive 32-bit words of a code row (N = 1, 2, 4: one vector load; 8: two, 4-bit keys at
// D = 256), or its first 16 bits (N = 0: a 2-byte share, 2-bit values at D = 64).
template <typename V, bool GLOBAL>
__device__ __forceinline__ V load(const V* p) {
  if constexpr (GLOBAL) {
    return __ldg(p);
  } else {
    return *p;
  }
}

template <int N, bool GLOBAL = true>
__device__ __forceinline__ void load_words(const uint8_t* row, uint32_t (&w)[N > 0 ? N : 1]) {
  if constexpr (N == 8) {
    const uint4 u = load<uint4, GLOBAL>(reinterpret_cast<const uint4*>(row));
    const uint4 v = load<uint4, GLOBAL>(reinterpret_cast<const uint4*>(row) + 1);
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w, w[4] = v.x, w[5] = v.y, w[6] = v.z, w[7] = v.w;
  } else if constexpr (N == 4) {
    const uint4 v = load<uint4, GLOBAL>(reinterpret_cast<const uint4*>(row));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (N == 2) {
    const uint2 v = load<uint2, GLOBAL>(reinterpret_cast<const uint2*>(row));
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (N == 1) {
    w[0] = load<uint32_t, GLOBAL>(reinterpret_cast<const uint32_t*>(row));
  } else {
    w[0] = load<uint16_t, GLOBAL>(reinterpret_cast<const uint16_t*>(row));
  }
}

// Where token t of kv row (b, h) lives: `row` of the code and v_scale/v_zero buffers, `key_row` of
// k_scale/k_zero (its key group). Static layout: bh * N + i. Paged (PAGED, a template parameter so
// the static kernel carries no paging code): row t % PS of page block_table[b, t / PS] (PS the
// page size), key row (t % PS) / G of the same page (a page holds whole key groups), the id
// clamped into the pool as kernels/triton/paging.py does. PS is a multiple of G, hence of 32: a
// 32-token chunk lies in one page, so the chunk's rows are `row` + 0..31.
template <bool PAGED>
__device__ __forceinline__ void token_rows(const DecodeParams& p, int b, int h, int t, size_t& row, size_t& key_row) {
  if constexpr (PAGED) {
    const int j = t / p.page_size, in_page = t - j * p.page_size;
    int page = __ldg(p.block_table + static_cast<size_t>(b) * p.max_pages + j);
    page = min(max(page, 0), p.num_pages - 1);
    const size_t ph = static_cast<size_t>(page) * p.kv_heads + h;
    row = ph * p.page_size + in_page;
    key_row = ph * (p.page_size / p.group) + in_page / p.group;
  } else {
    const size_t bh = static_cast<size_t>(b) * p.kv_heads + h;
    row = bh * p.max_tokens + t;
    key_row = bh * ((p.max_tokens + p.group - 1) / p.group) + t / p.group;
  }
}

struct RowCounts {
  int length, nqk, nqv, chunks;
};

__device__ __forceinline__ RowCounts row_counts(const DecodeParams& p, int b) {
  int L = static_cast<int>(p.lengths[b]);
  if (p.counts != nullptr && p.counts[b] == 0) L = 0;  // padding row: attends to nothing
  int nqk, nqv;
  if (p.ott_policy) {
    nqk = nqv = max(L - p.residual, 0) / p.group * p.group;
  } else {
    nqk = L / p.residual * p.residual;
    nqv = max(L - p.residual, 0);
  }
  return {L, nqk, nqv, min(nqk, nqv) / kChunk};
}

// Per-warp partial state in the layout the block merge reads.
template <int D>
struct Merge {
  float acc[kWarps][kHeads][D];
  float m[kWarps][kHeads], l[kWarps][kHeads];
};

// One stage of the cp.async ring (a warp's chunk in shared memory): the chunk's key and value code
// rows, its key group's scales and zeros, its tokens' value scales and zeros (at most D / 32 value
// groups per token: Gv >= 32). Every part is a multiple of 16 bytes, every offset 16-aligned.
template <int D, int KB, int VB>
struct Stage {
  static constexpr int kKeys = kChunk * D * KB / 8, kValues = kChunk * D * VB / 8;
  static constexpr int kKeyScales = 2 * D, kValueScales = kChunk * 2 * (D / 32);
  static constexpr int kV = kKeys, kKS = kV + kValues, kKZ = kKS + kKeyScales, kVS = kKZ + kKeyScales;
  static constexpr int kVZ = kVS + kValueScales, kBytes = kVZ + kValueScales;
  // the stages built: KIVI_DECODE_STAGES, halved while the block's ring would pass 64 KB (D = 256 at
  // 4-bit codes: one stage, the direct loads)
  static constexpr int kStagesBuilt = kStages == 4 && 4 * kWarps * kBytes <= kRingLimit   ? 4
                                      : kStages >= 2 && 2 * kWarps * kBytes <= kRingLimit ? 2
                                                                                          : 1;
  static constexpr int kRing = kStagesBuilt > 1 ? kStagesBuilt * kWarps * kBytes : 0;  // dynamic shared bytes per block
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// The warp copies BYTES (a multiple of 16) from global to shared memory, or only the first `bytes`
// where given: lane copies the 16-byte pieces lane, lane + 32, ...
template <int BYTES>
__device__ __forceinline__ void warp_copy(uint8_t* dst, const void* src, int lane, int bytes = -1) {
#pragma unroll
  for (int k = 0; k < (BYTES + 511) / 512; ++k) {
    const int i = 16 * lane + 512 * k;
    if ((BYTES % 512 == 0 && bytes < 0) || i < (bytes < 0 ? BYTES : bytes)) {
      cp_async16(dst + i, static_cast<const uint8_t*>(src) + i);
    }
  }
}

// Where a quantized chunk's data is read: global memory (GLOBAL: __ldg) or a stage.
template <typename T>
struct ChunkSource {
  const uint8_t *k_codes, *v_codes;  // row 0 of the chunk
  const T *k_scale, *k_zero;         // the chunk's key group
  const T *v_scale, *v_zero;         // row 0 of the chunk, ngv per row
};

// A warp's softmax state: heads 2 tig and 2 tig + 1 (m, l), and its output fragment.
template <int D>
struct WarpState {
  float acc[D / 16][4];
  float m0, m1, l0, l1;
  uint32_t magic[4];  // kMagicKeys: the magic MMA's A (-M of rows g; rows g + 8 unused: 0 and 1)
};

template <int D, int KB, int VB, bool PAGED, typename T>
__device__ __forceinline__ ChunkSource<T> global_source(const DecodeParams& p, int b, int h, int t0, int ngv) {
  size_t r0, kr;
  token_rows<PAGED>(p, b, h, t0, r0, kr);
  return {p.k_codes + r0 * (D * KB / 8), p.v_codes + r0 * (D * VB / 8),
          reinterpret_cast<const T*>(p.k_scale) + kr * D, reinterpret_cast<const T*>(p.k_zero) + kr * D,
          reinterpret_cast<const T*>(p.v_scale) + r0 * ngv, reinterpret_cast<const T*>(p.v_zero) + r0 * ngv};
}

// Issue the cp.async copies of a chunk's data into `stage` (one commit group is the caller's).
template <int D, int KB, int VB, typename T>
__device__ __forceinline__ void issue_stage(uint8_t* stage, const ChunkSource<T>& g, int ngv, int lane) {
  using S = Stage<D, KB, VB>;
  warp_copy<S::kKeys>(stage, g.k_codes, lane);
  warp_copy<S::kValues>(stage + S::kV, g.v_codes, lane);
  warp_copy<S::kKeyScales>(stage + S::kKS, g.k_scale, lane);
  warp_copy<S::kKeyScales>(stage + S::kKZ, g.k_zero, lane);
  warp_copy<S::kValueScales>(stage + S::kVS, g.v_scale, lane, kChunk * 2 * ngv);
  warp_copy<S::kValueScales>(stage + S::kVZ, g.v_zero, lane, kChunk * 2 * ngv);
}

template <int D, int KB, int VB, typename T>
__device__ __forceinline__ ChunkSource<T> stage_source(const uint8_t* stage) {
  using S = Stage<D, KB, VB>;
  return {stage, stage + S::kV, reinterpret_cast<const T*>(stage + S::kKS), reinterpret_cast<const T*>(stage + S::kKZ),
          reinterpret_cast<const T*>(stage + S::kVS), reinterpret_cast<const T*>(stage + S::kVZ)};
}

// The key A fragment (a0..a3) of k-step s: the exact codes as 16-bit pairs, from a lane's words of
// rows g (w0) and g + 8 (w1). MAGIC (KIVI_DECODE_FOLD16 = 2): M + c instead, without the fma2.
// key_magic: the two halves' M for a0, a1 (and a2, a3: y), where a code at bit k of a half reads
// 2^(10 - k) + c (bf16: 2^(7 - k) + c).
template <int KB, typename T>
__host__ __device__ constexpr uint32_t key_magic(bool y) {
  // the low half's code at bit lo, the high half's at bit hi
  const int lo = Num<T>::kShiftHigh || KB == 4 || !y ? 0 : 4;
  const int hi = Num<T>::kShiftHigh ? (KB == 2 ? 2 : 0) : KB == 4 ? 4 : lo + 2;
  return (Num<T>::magic_at(lo) & 0xFFFFu) | (Num<T>::magic_at(hi) & 0xFFFF0000u);
}

template <int KB, typename T, bool MAGIC = false>
__device__ __forceinline__ void key_codes(uint32_t w0, uint32_t w1, int s, uint32_t& a0, uint32_t& a1, uint32_t& a2,
                                          uint32_t& a3) {
  using N = Num<T>;
  if constexpr (KB == 2 && N::kShiftHigh) {
    // bf16: codes 0 and 1 of byte s % 4 as below; codes 2 and 3 from the word shifted by 4, where
    // they sit at codes 0 and 1's bits (128 + 4 * 3 at most: no carry into the exponent).
    const uint32_t sel = (s % 4) * 0x0101u;
    const uint32_t x0 = prmt(w0, 0, sel), x1 = prmt(w1, 0, sel);
    const uint32_t y0 = prmt(w0 >> 4, 0, sel), y1 = prmt(w1 >> 4, 0, sel);
    if constexpr (MAGIC) {
      constexpr uint32_t M = key_magic<KB, T>(false);
      a0 = magic<0x000C0003u, M>(x0), a1 = magic<0x000C0003u, M>(x1);
      a2 = magic<0x000C0003u, M>(y0), a3 = magic<0x000C0003u, M>(y1);
      return;
    }
    a0 = N::fma2(magic<0x000C0003u, 0x43004300u>(x0), 0x3E803F80u, 0xC200C300u);
    a1 = N::fma2(magic<0x000C0003u, 0x43004300u>(x1), 0x3E803F80u, 0xC200C300u);
    a2 = N::fma2(magic<0x000C0003u, 0x43004300u>(y0), 0x3E803F80u, 0xC200C300u);
    a3 = N::fma2(magic<0x000C0003u, 0x43004300u>(y1), 0x3E803F80u, 0xC200C300u);
  } else if constexpr (N::kShiftHigh) {
    // bf16, 4-bit: byte b of the word into byte 0, byte b of the word shifted by 4 (its high
    // nibble low) into byte 2; one mask takes both nibbles as 128 + c.
    const int lo = 2 * (s % 2), hi = lo + 1;
    const uint32_t x0 = prmt(w0, w0 >> 4, lo | (4 + lo) << 8), x1 = prmt(w1, w1 >> 4, lo | (4 + lo) << 8);
    const uint32_t y0 = prmt(w0, w0 >> 4, hi | (4 + hi) << 8), y1 = prmt(w1, w1 >> 4, hi | (4 + hi) << 8);
    if constexpr (MAGIC) {
      a0 = magic<0x000F000Fu, 0x43004300u>(x0), a1 = magic<0x000F000Fu, 0x43004300u>(x1);
      a2 = magic<0x000F000Fu, 0x43004300u>(y0), a3 = magic<0x000F000Fu, 0x43004300u>(y1);
      return;
    }
    a0 = N::fma2(magic<0x000F000Fu, 0x43004300u>(x0), 0x3F803F80u, 0xC300C300u);
    a1 = N::fma2(magic<0x000F000Fu, 0x43004300u>(x1), 0x3F803F80u, 0xC300C300u);
    a2 = N::fma2(magic<0x000F000Fu, 0x43004300u>(y0), 0x3F803F80u, 0xC300C300u);
    a3 = N::fma2(magic<0x000F000Fu, 0x43004300u>(y1), 0x3F803F80u, 0xC300C300u);
  } else if constexpr (KB == 2) {
    const uint32_t sel = (s % 4) * 0x0101u;  // byte s % 4 into bytes 0 and 2 (1 and 3: masked off)
    const uint32_t x0 = prmt(w0, 0, sel), x1 = prmt(w1, 0, sel);
    // k index 2 tig + {0, 1}: codes 0 and 1 of the byte; 2 tig + 8 + {0, 1}: codes 2 and 3.
    if constexpr (MAGIC) {
      a0 = magic<0x000C0003u, key_magic<KB, T>(false)>(x0), a1 = magic<0x000C0003u, key_magic<KB, T>(false)>(x1);
      a2 = magic<0x00C00030u, key_magic<KB, T>(true)>(x0), a3 = magic<0x00C00030u, key_magic<KB, T>(true)>(x1);
      return;
    }
    a0 = N::fma2(magic<0x000C0003u, 0x64006400u>(x0), 0x34003C00u, 0xDC00E400u);
    a1 = N::fma2(magic<0x000C0003u, 0x64006400u>(x1), 0x34003C00u, 0xDC00E400u);
    a2 = N::fma2(magic<0x00C00030u, 0x64006400u>(x0), 0x24002C00u, 0xCC00D400u);
    a3 = N::fma2(magic<0x00C00030u, 0x64006400u>(x1), 0x24002C00u, 0xCC00D400u);
  } else {
    // k index 2 tig + {0, 1}: the two nibbles of byte 2 (s % 2); 2 tig + 8 + {0, 1}: of the next byte.
    const uint32_t lo = 2 * (s % 2) * 0x0101u, hi = lo + 0x0101u;
    const uint32_t x0 = prmt(w0, 0, lo), x1 = prmt(w1, 0, lo);
    const uint32_t y0 = prmt(w0, 0, hi), y1 = prmt(w1, 0, hi);
    if constexpr (MAGIC) {
      constexpr uint32_t M = key_magic<KB, T>(false);
      a0 = magic<0x00F0000Fu, M>(x0), a1 = magic<0x00F0000Fu, M>(x1);
      a2 = magic<0x00F0000Fu, M>(y0), a3 = magic<0x00F0000Fu, M>(y1);
      return;
    }
    a0 = N::fma2(magic<0x00F0000Fu, 0x64006400u>(x0), 0x2C003C00u, 0xD400E400u);
    a1 = N::fma2(magic<0x00F0000Fu, 0x64006400u>(x1), 0x2C003C00u, 0xD400E400u);
    a2 = N::fma2(magic<0x00F0000Fu, 0x64006400u>(y0), 0x2C003C00u, 0xD400E400u);
    a3 = N::fma2(magic<0x00F0000Fu, 0x64006400u>(y1), 0x2C003C00u, 0xD400E400u);
  }
}

// The value A fragments of k-step half ks (tokens 16 ks + 4 tig + {0..3} of the chunk) for every
// m-tile: v = v_scale * code + v_zero in 16 bits, tokens (0, 1) / (2, 3) in the low / high halves of
// registers 0, 1 / 2, 3 (rows g / g + 8). w: the 4 tokens' words, S01 .. Z23 their scales and zeros.
template <int D, int VB, typename T>
__device__ __forceinline__ void value_fragments(const uint32_t (&w)[4][(D * VB / 64) / 4 > 0 ? (D * VB / 64) / 4 : 1],
                                                uint32_t S01, uint32_t S23, uint32_t Z01, uint32_t Z23,
                                                uint32_t (&a)[D / 16][4]) {
  using N = Num<T>;
  constexpr int VBPT = D * VB / 64;
#pragma unroll
  for (int j = 0; j < VBPT; ++j) {
    const uint32_t sel = (j % 4) | ((4 + j % 4) << 8);  // byte j of tokens (0, 1) / (2, 3) into bytes 0 and 2
    const uint32_t x01 = prmt(w[0][j / 4], w[1][j / 4], sel), x23 = prmt(w[2][j / 4], w[3][j / 4], sel);
    if constexpr (VB == 2) {
      // m-tile 2j: rows g / g + 8 are codes 0 / 1 of byte j; m-tile 2j + 1: codes 2 / 3.
      a[2 * j][0] = N::fma2(codes_at<T, 2, 0>(x01), S01, Z01), a[2 * j][1] = N::fma2(codes_at<T, 2, 1>(x01), S01, Z01);
      a[2 * j][2] = N::fma2(codes_at<T, 2, 0>(x23), S23, Z23), a[2 * j][3] = N::fma2(codes_at<T, 2, 1>(x23), S23, Z23);
      a[2 * j + 1][0] = N::fma2(codes_at<T, 2, 2>(x01), S01, Z01);
      a[2 * j + 1][1] = N::fma2(codes_at<T, 2, 3>(x01), S01, Z01);
      a[2 * j + 1][2] = N::fma2(codes_at<T, 2, 2>(x23), S23, Z23);
      a[2 * j + 1][3] = N::fma2(codes_at<T, 2, 3>(x23), S23, Z23);
    } else {
      // m-tile j: rows g / g + 8 are the low / high nibble of byte j.
      a[j][0] = N::fma2(codes_at<T, 4, 0>(x01), S01, Z01), a[j][1] = N::fma2(codes_at<T, 4, 1>(x01), S01, Z01);
      a[j][2] = N::fma2(codes_at<T, 4, 0>(x23), S23, Z23), a[j][3] = N::fma2(codes_at<T, 4, 1>(x23), S23, Z23);
    }
  }
}

// Online softmax (base 2) per head over the chunk's scores (heads 2 tig: c0, c2; 2 tig + 1: c1, c3),
// p into the warp's transpose buffer, the output rescaled. BIAS false: the scores hold their bias
// already (no additions).
template <int D, bool BIAS = true>
__device__ __forceinline__ void online_softmax(const float (&sc)[2][4], float bias0, float bias1, float (*p_s)[kPStride],
                                               WarpState<D>& st, int g, int tig) {
  if constexpr (!BIAS) bias0 = bias1 = 0.f;
  float mx0 = fmaxf(fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[1][0], sc[1][2]));
  float mx1 = fmaxf(fmaxf(sc[0][1], sc[0][3]), fmaxf(sc[1][1], sc[1][3]));
  if constexpr (BIAS) mx0 += bias0, mx1 += bias1;
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float n0 = fmaxf(st.m0, mx0), n1 = fmaxf(st.m1, mx1);
  const float al0 = fast_exp2(st.m0 - n0), al1 = fast_exp2(st.m1 - n1);
  st.m0 = n0;
  st.m1 = n1;
  st.l0 *= al0;
  st.l1 *= al1;
  __syncwarp();  // the previous chunk's p reads are done
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const float s00 = BIAS ? sc[mt][0] + bias0 : sc[mt][0], s01 = BIAS ? sc[mt][1] + bias1 : sc[mt][1];
    const float s10 = BIAS ? sc[mt][2] + bias0 : sc[mt][2], s11 = BIAS ? sc[mt][3] + bias1 : sc[mt][3];
    const float p00 = fast_exp2(s00 - n0), p01 = fast_exp2(s01 - n1);
    const float p10 = fast_exp2(s10 - n0), p11 = fast_exp2(s11 - n1);
    st.l0 += p00 + p10;
    st.l1 += p01 + p11;
    p_s[2 * tig][16 * mt + g] = p00;
    p_s[2 * tig + 1][16 * mt + g] = p01;
    p_s[2 * tig][16 * mt + g + 8] = p10;
    p_s[2 * tig + 1][16 * mt + g + 8] = p11;
  }
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    st.acc[mt][0] *= al0;
    st.acc[mt][1] *= al1;
    st.acc[mt][2] *= al0;
    st.acc[mt][3] *= al1;
  }
  __syncwarp();
}

// One fully quantized chunk (32 tokens of one key group) from `src`: global memory (GLOBAL) or a stage.
template <int D, int KB, int VB, typename T, bool GLOBAL>
__device__ __forceinline__ void quantized_chunk(const float (*q_s)[D], const uint16_t (*q16)[D], float (*p_s)[kPStride],
                                                const ChunkSource<T>& src, int ngv, int vgroup, WarpState<D>& st) {
  using N = Num<T>;
  constexpr int KS = D / 16, MT = D / 16;
  constexpr int KROW = D * KB / 8, VROW = D * VB / 8;  // bytes of a token's key / value codes
  constexpr int KWPT = KROW / 16, VBPT = VROW / 8, VW = VBPT / 4;  // words per lane, bytes per lane group
  const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  // q' = q * k_scale of head g over this lane's channels, and the zero dot q . z (partial).
  uint32_t qk[KS][2];
  float bias0 = 0.f, bias1 = 0.f;
  float sc0[4] = {0.f, 0.f, 0.f, 0.f};  // the scores' start: rows g, g + 8 x heads 2 tig, 2 tig + 1
  if constexpr (kMagicKeys) {
    // The bias is the same for every token row, so an MMA's row g + 8 may hold other products: per two
    // k-steps (8 channels from c0: 01 23 45 67 in pairs) A is the zeros as loaded, z01 z23 z45 z67, and
    // B (q01, q45) gives z01 q01 + z45 q45 in row g of acc, B (q23, q67) z23 q23 + z67 q67 in row g + 8
    // of acc8 (q16's copy is stored in that pair order: no register moves).
    const uint32_t(&mq)[4] = st.magic;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc8[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < KS; s += 2) {
      const int c0 = k_channel<D, KB>(s, tig, 0);  // k-steps s and s + 1: channels c0 .. c0 + 7
      const uint4 qv = *reinterpret_cast<const uint4*>(&q16[g][c0]);  // q01 q45 q23 q67
      const uint4 sv = *reinterpret_cast<const uint4*>(src.k_scale + c0), zv = *reinterpret_cast<const uint4*>(src.k_zero + c0);
      qk[s][0] = N::fma2(qv.x, sv.x, 0x80008000u);
      qk[s][1] = N::fma2(qv.z, sv.y, 0x80008000u);
      qk[s + 1][0] = N::fma2(qv.y, sv.z, 0x80008000u);
      qk[s + 1][1] = N::fma2(qv.w, sv.w, 0x80008000u);
      N::mma(acc, zv.x, zv.y, zv.z, zv.w, qv.x, qv.y);  // + q16 . z
      N::mma(acc8, zv.x, zv.y, zv.z, zv.w, qv.z, qv.w);
      N::mma(acc, mq[0], mq[1], mq[2], mq[3], qk[s][0], qk[s][1]);  // - q' . M
      N::mma(acc, mq[0], mq[1], mq[2], mq[3], qk[s + 1][0], qk[s + 1][1]);
    }
    sc0[0] = sc0[2] = acc[0] + acc8[2];
    sc0[1] = sc0[3] = acc[1] + acc8[3];
  } else if constexpr (kFold16) {
    float zsc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g + 8 (equal) x heads 2 tig, 2 tig + 1
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int ch = k_channel<D, KB>(s, tig, 0);
      const float4 qv = *reinterpret_cast<const float4*>(&q_s[g][ch]);
      const uint2 sv = *reinterpret_cast<const uint2*>(src.k_scale + ch), zv = *reinterpret_cast<const uint2*>(src.k_zero + ch);
      const uint32_t q01 = N::pack(qv.x, qv.y), q23 = N::pack(qv.z, qv.w);
      qk[s][0] = N::fma2(q01, sv.x, 0x80008000u);  // + (-0): the product, rounded once
      qk[s][1] = N::fma2(q23, sv.y, 0x80008000u);
      N::mma(zsc, zv.x, zv.x, zv.y, zv.y, q01, q23);
    }
    bias0 = zsc[0];
    bias1 = zsc[1];
  } else {
    float zdot = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int ch = k_channel<D, KB>(s, tig, 0);
      const float4 qv = *reinterpret_cast<const float4*>(&q_s[g][ch]);
      const uint2 sv = *reinterpret_cast<const uint2*>(src.k_scale + ch);  // 4 channels' scales and zeros
      const uint2 zv = *reinterpret_cast<const uint2*>(src.k_zero + ch);
      const T* s4 = reinterpret_cast<const T*>(&sv);
      const T* z4 = reinterpret_cast<const T*>(&zv);
      qk[s][0] = N::pack(qv.x * N::to_float(s4[0]), qv.y * N::to_float(s4[1]));
      qk[s][1] = N::pack(qv.z * N::to_float(s4[2]), qv.w * N::to_float(s4[3]));
      zdot += qv.x * N::to_float(z4[0]) + qv.y * N::to_float(z4[1]) + qv.z * N::to_float(z4[2]) +
              qv.w * N::to_float(z4[3]);
    }
    zdot += __shfl_xor_sync(0xffffffffu, zdot, 1);
    zdot += __shfl_xor_sync(0xffffffffu, zdot, 2);
    bias0 = __shfl_sync(0xffffffffu, zdot, 8 * tig);      // head 2 tig lives in group 2 tig
    bias1 = __shfl_sync(0xffffffffu, zdot, 8 * tig + 4);  // head 2 tig + 1
  }

  // Scores of the chunk's 32 tokens: m-tile mt holds tokens t0 + 16 mt + {g, g + 8}.
  float sc[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t w[2][KWPT];  // rows g and g + 8
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      load_words<KWPT, GLOBAL>(src.k_codes + static_cast<size_t>(16 * mt + g + 8 * r) * KROW + 4 * KWPT * tig, w[r]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) sc[mt][r] = sc0[r];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      uint32_t a0, a1, a2, a3;
      key_codes<KB, T, kMagicKeys>(w[0][KB == 2 ? s / 4 : s / 2], w[1][KB == 2 ? s / 4 : s / 2], s, a0, a1, a2, a3);
      N::mma(sc[mt], a0, a1, a2, a3, qk[s][0], qk[s][1]);
    }
  }
  online_softmax<D, !kMagicKeys>(sc, bias0, bias1, p_s, st, g, tig);

  // PV: k-step ks covers tokens t0 + 16 ks + 4 tig + {0..3} (k index 2 tig + e <-> token 4 tig + e,
  // 2 tig + 8 + e <-> token 4 tig + 2 + e), head g.
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const float4 pv = *reinterpret_cast<const float4*>(&p_s[g][16 * ks + 4 * tig]);
    const uint32_t b0 = N::pack(pv.x, pv.y), b1 = N::pack(pv.z, pv.w);
    const int t = 16 * ks + 4 * tig;  // relative to the chunk's first row
    uint32_t w[4][VW > 0 ? VW : 1];
    T sc_h[4], zr_h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      load_words<VW, GLOBAL>(src.v_codes + static_cast<size_t>(t + e) * VROW + g * VBPT, w[e]);
      sc_h[e] = src.v_scale[static_cast<size_t>(t + e) * ngv + vgroup];
      zr_h[e] = src.v_zero[static_cast<size_t>(t + e) * ngv + vgroup];
    }
    const uint32_t S01 = bits_of(sc_h[0]) | bits_of(sc_h[1]) << 16, S23 = bits_of(sc_h[2]) | bits_of(sc_h[3]) << 16;
    const uint32_t Z01 = bits_of(zr_h[0]) | bits_of(zr_h[1]) << 16, Z23 = bits_of(zr_h[2]) | bits_of(zr_h[3]) << 16;
    uint32_t a[MT][4];
    value_fragments<D, VB, T>(w, S01, S23, Z01, Z23, a);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) N::mma(st.acc[mt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
  }
}

// A chunk that is not fully quantized (residual in the loop): tokens [t0, t0 + 32) of the row, each
// key a quantized one (t < nqk), a residual one (t < L) or none (masked), each value likewise with
// nqv. The keys are dequantized in 16 bits (v_scale * code + v_zero, one rounding) and meet the
// unscaled 16-bit query in the MMA (no fold: the chunk's rows mix sources); values as the quantized
// chunk's, the residual tokens' own 16 bits in their halves.
template <int D, int KB, int VB, bool PAGED, typename T>
__device__ __forceinline__ void mixed_chunk(const DecodeParams& p, const float (*q_s)[D], float (*p_s)[kPStride], int b,
                                            int h, int t0, const RowCounts& rc, int ngv, int vgroup, WarpState<D>& st) {
  using N = Num<T>;
  constexpr int KS = D / 16, MT = D / 16;
  constexpr int KROW = D * KB / 8, VROW = D * VB / 8;
  constexpr int KWPT = KROW / 16, VBPT = VROW / 8, VW = VBPT / 4;
  constexpr int RW = D / 16;  // words of a lane group's D / 8 residual values
  const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const ChunkSource<T> src = global_source<D, KB, VB, PAGED, T>(p, b, h, t0, ngv);
  const size_t bh = static_cast<size_t>(b) * p.kv_heads + h;
  const T *k_res = reinterpret_cast<const T*>(p.k_res), *v_res = reinterpret_cast<const T*>(p.v_res);

  float sc[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t w[2][KWPT];
    bool quant[2];
    const T* res[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = t0 + 16 * mt + g + 8 * r;
      quant[r] = t < rc.nqk;
      res[r] = t < rc.length ? k_res + (bh * p.slots + t % p.slots) * D : nullptr;
      if (quant[r]) {
        load_words<KWPT, true>(src.k_codes + static_cast<size_t>(16 * mt + g + 8 * r) * KROW + 4 * KWPT * tig, w[r]);
      } else {
#pragma unroll
        for (int i = 0; i < KWPT; ++i) w[r][i] = 0;
      }
    }
    sc[mt][0] = sc[mt][1] = sc[mt][2] = sc[mt][3] = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int ch = k_channel<D, KB>(s, tig, 0);
      const float4 qv = *reinterpret_cast<const float4*>(&q_s[g][ch]);
      const uint2 sv = *reinterpret_cast<const uint2*>(src.k_scale + ch), zv = *reinterpret_cast<const uint2*>(src.k_zero + ch);
      uint32_t a0, a1, a2, a3;
      key_codes<KB, T>(w[0][KB == 2 ? s / 4 : s / 2], w[1][KB == 2 ? s / 4 : s / 2], s, a0, a1, a2, a3);
      // rows g (a0: channels ch, ch + 1; a2: ch + 2, ch + 3) and g + 8 (a1, a3)
      uint2 r0 = make_uint2(0, 0), r1 = make_uint2(0, 0);
      if (!quant[0] && res[0] != nullptr) r0 = *reinterpret_cast<const uint2*>(res[0] + ch);
      if (!quant[1] && res[1] != nullptr) r1 = *reinterpret_cast<const uint2*>(res[1] + ch);
      a0 = quant[0] ? N::fma2(a0, sv.x, zv.x) : r0.x;
      a2 = quant[0] ? N::fma2(a2, sv.y, zv.y) : r0.y;
      a1 = quant[1] ? N::fma2(a1, sv.x, zv.x) : r1.x;
      a3 = quant[1] ? N::fma2(a3, sv.y, zv.y) : r1.y;
      N::mma(sc[mt], a0, a1, a2, a3, N::pack(qv.x, qv.y), N::pack(qv.z, qv.w));
    }
    if (t0 + 16 * mt + g >= rc.length) sc[mt][0] = sc[mt][1] = -INFINITY;
    if (t0 + 16 * mt + g + 8 >= rc.length) sc[mt][2] = sc[mt][3] = -INFINITY;
  }
  online_softmax(sc, 0.f, 0.f, p_s, st, g, tig);

#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const float4 pv = *reinterpret_cast<const float4*>(&p_s[g][16 * ks + 4 * tig]);
    const uint32_t b0 = N::pack(pv.x, pv.y), b1 = N::pack(pv.z, pv.w);
    const int t = 16 * ks + 4 * tig;
    uint32_t w[4][VW > 0 ? VW : 1], rv[4][RW];
    uint16_t sc_h[4], zr_h[4];
    bool resid[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = t0 + t + e;
      const bool quant = tok < rc.nqv;
      resid[e] = !quant && tok < rc.length;
#pragma unroll
      for (int i = 0; i < (VW > 0 ? VW : 1); ++i) w[e][i] = 0;
      sc_h[e] = zr_h[e] = 0;  // a token that is neither: codes, scale and zero 0, so v = 0
      if (quant) {
        load_words<VW, true>(src.v_codes + static_cast<size_t>(t + e) * VROW + g * VBPT, w[e]);
        sc_h[e] = bits_of(src.v_scale[static_cast<size_t>(t + e) * ngv + vgroup]);
        zr_h[e] = bits_of(src.v_zero[static_cast<size_t>(t + e) * ngv + vgroup]);
      }
#pragma unroll
      for (int i = 0; i < RW; ++i) rv[e][i] = 0;
      if (resid[e]) {
        const uint4* row = reinterpret_cast<const uint4*>(v_res + (bh * p.slots + tok % p.slots) * D + g * (D / 8));
#pragma unroll
        for (int i = 0; i < RW / 4; ++i) {
          const uint4 x = row[i];
          rv[e][4 * i] = x.x, rv[e][4 * i + 1] = x.y, rv[e][4 * i + 2] = x.z, rv[e][4 * i + 3] = x.w;
        }
      }
    }
    const uint32_t S01 = sc_h[0] | uint32_t(sc_h[1]) << 16, S23 = sc_h[2] | uint32_t(sc_h[3]) << 16;
    const uint32_t Z01 = zr_h[0] | uint32_t(zr_h[1]) << 16, Z23 = zr_h[2] | uint32_t(zr_h[3]) << 16;
    uint32_t a[MT][4];
    value_fragments<D, VB, T>(w, S01, S23, Z01, Z23, a);
    // a token pair's halves: the dequantized value (prmt bytes 0-3) or the residual one (4-7)
    const uint32_t pick01 = (resid[0] ? 0x0054u : 0x0010u) | (resid[1] ? 0x7600u : 0x3200u);
    const uint32_t pick23 = (resid[2] ? 0x0054u : 0x0010u) | (resid[3] ? 0x7600u : 0x3200u);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int c = v_channel<D, VB>(mt, 0, r & 1);  // the channel within the lane group's D / 8
        const int e0 = 2 * (r >> 1);
        const uint32_t pair = prmt(rv[e0][c / 2], rv[e0 + 1][c / 2], c % 2 ? 0x7632u : 0x5410u);
        a[mt][r] = prmt(a[mt][r], pair, r >> 1 ? pick23 : pick01);
      }
      N::mma(st.acc[mt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
    }
  }
}

// One warp's chunks [c, c_end) step kWarps: the fully quantized ones (c < c_quant) through the
// stage ring when the build has one, then (KIVI_DECODE_RESIDUAL_IN_LOOP) the mixed ones. Writes
// its (m, l, acc) into `merge`.
template <int D, int KB, int VB, bool PAGED, typename T>
__device__ void warp_chunks(const DecodeParams& p, const float (*q_s)[D], const uint16_t (*q16)[D], float (*p_s)[kPStride],
                            Merge<D>& merge,
                            uint8_t* ring, int b, int h, int c, int c_quant, int c_end, const RowCounts& rc) {
  constexpr int MT = D / 16, S = Stage<D, KB, VB>::kStagesBuilt;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const int Gv = min(p.group, D), ngv = D / Gv;
  const int vgroup = g * (D / 8) / Gv;  // this lane group's value group (its D / 8 channels lie in one)
  WarpState<D> st;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) st.acc[mt][0] = st.acc[mt][1] = st.acc[mt][2] = st.acc[mt][3] = 0.f;
  st.m0 = st.m1 = -INFINITY;
  st.l0 = st.l1 = 0.f;
  if constexpr (kMagicKeys) {
    // through a shuffle: registers that ptxas keeps for the whole loop instead of rebuilding the
    // quad from immediates before every magic MMA (4 moves each)
    const uint32_t a[4] = {key_magic<KB, T>(false) | 0x80008000u, 0u, key_magic<KB, T>(true) | 0x80008000u, 1u};
#pragma unroll
    for (int i = 0; i < 4; ++i) st.magic[i] = __shfl_sync(0xffffffffu, a[i], 0);
  }

  if constexpr (S == 1) {
    for (; c < c_quant; c += kWarps) {
      quantized_chunk<D, KB, VB, T, true>(q_s, q16, p_s, global_source<D, KB, VB, PAGED, T>(p, b, h, c * kChunk, ngv), ngv,
                                          vgroup, st);
    }
  } else {
    // chunk i of this warp (c + i kWarps) lands in stage i % S; S - 1 chunks are in flight ahead of the one computed
    using St = Stage<D, KB, VB>;
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      const int ci = c + i * kWarps;
      if (ci < c_quant) issue_stage<D, KB, VB, T>(ring + i * St::kBytes, global_source<D, KB, VB, PAGED, T>(p, b, h, ci * kChunk, ngv), ngv, lane);
      cp_async_commit();
    }
    for (int i = 0; c < c_quant; c += kWarps, ++i) {
      __syncwarp();  // the stage written next was read by the previous iteration
      const int ahead = c + (S - 1) * kWarps;
      if (ahead < c_quant) {
        issue_stage<D, KB, VB, T>(ring + ((i + S - 1) % S) * St::kBytes,
                                  global_source<D, KB, VB, PAGED, T>(p, b, h, ahead * kChunk, ngv), ngv, lane);
      }
      cp_async_commit();
      cp_async_wait<S - 1>();  // this lane's copies of chunk i have landed
      __syncwarp();            // and every lane's
      quantized_chunk<D, KB, VB, T, false>(q_s, q16, p_s, stage_source<D, KB, VB, T>(ring + (i % S) * St::kBytes), ngv,
                                           vgroup, st);
    }
  }
  if constexpr (kResidualInLoop) {
    for (; c < c_end; c += kWarps) mixed_chunk<D, KB, VB, PAGED, T>(p, q_s, p_s, b, h, c * kChunk, rc, ngv, vgroup, st);
  }

  // Row sums over the 8 lane groups, then the warp's state in head-major layout.
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, off);
    st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, off);
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ch = v_channel<D, VB>(mt, g, 0);
    merge.acc[warp][2 * tig][ch] = st.acc[mt][0];
    merge.acc[warp][2 * tig + 1][ch] = st.acc[mt][1];
    merge.acc[warp][2 * tig][ch + 1] = st.acc[mt][2];
    merge.acc[warp][2 * tig + 1][ch + 1] = st.acc[mt][3];
  }
  if (g == 0) {
    merge.m[warp][2 * tig] = st.m0;
    merge.m[warp][2 * tig + 1] = st.m1;
    merge.l[warp][2 * tig] = st.l0;
    merge.l[warp][2 * tig + 1] = st.l1;
  }
}

// One warp's tail tokens [t, L) step kWarps, in fp32: lane owns channels lane * CPL + i.
template <int D, int KB, int VB, bool PAGED, typename T>
__device__ void tail_tokens(const DecodeParams& p, const float (*q_s)[D], Merge<D>& merge, int b, int h, int t,
                            const RowCounts& rc, int heads) {
  constexpr int CPL = D / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int Gv = min(p.group, D), ngv = D / Gv;
  const size_t bh = static_cast<size_t>(b) * p.kv_heads + h;
  using N = Num<T>;
  const T *k_scale = reinterpret_cast<const T*>(p.k_scale), *k_zero = reinterpret_cast<const T*>(p.k_zero);
  const T *v_scale = reinterpret_cast<const T*>(p.v_scale), *v_zero = reinterpret_cast<const T*>(p.v_zero);
  const T *k_res = reinterpret_cast<const T*>(p.k_res), *v_res = reinterpret_cast<const T*>(p.v_res);
  float q[kHeads][CPL], acc[kHeads][CPL], m[kHeads], l[kHeads];
#pragma unroll
  for (int n = 0; n < kHeads; ++n) {
    m[n] = -INFINITY;
    l[n] = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      q[n][i] = q_s[n][lane * CPL + i];
      acc[n][i] = 0.f;
    }
  }
  for (; t < rc.length; t += kWarps) {
    float k[CPL], v[CPL];
    const int slot = t % p.slots;
    size_t row, kr;
    token_rows<PAGED>(p, b, h, t, row, kr);
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int ch = lane * CPL + i;
      if (t < rc.nqk) {
        const int code = (p.k_codes[row * (D * KB / 8) + ch * KB / 8] >> (KB * (ch % (8 / KB)))) & ((1 << KB) - 1);
        const size_t kidx = kr * D + ch;
        k[i] = code * N::to_float(k_scale[kidx]) + N::to_float(k_zero[kidx]);
      } else {
        k[i] = N::to_float(k_res[(bh * p.slots + slot) * D + ch]);
      }
      if (t < rc.nqv) {
        const int code = (p.v_codes[row * (D * VB / 8) + ch * VB / 8] >> (VB * (ch % (8 / VB)))) & ((1 << VB) - 1);
        const size_t vidx = row * ngv + ch / Gv;
        v[i] = code * N::to_float(v_scale[vidx]) + N::to_float(v_zero[vidx]);
      } else {
        v[i] = N::to_float(v_res[(bh * p.slots + slot) * D + ch]);
      }
    }
#pragma unroll
    for (int n = 0; n < kHeads; ++n) {
      if (n >= heads) break;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) s += q[n][i] * k[i];
#pragma unroll
      for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
      const float mn = fmaxf(m[n], s), alpha = fast_exp2(m[n] - mn), pr = fast_exp2(s - mn);
      m[n] = mn;
      l[n] = l[n] * alpha + pr;
#pragma unroll
      for (int i = 0; i < CPL; ++i) acc[n][i] = acc[n][i] * alpha + pr * v[i];
    }
  }
#pragma unroll
  for (int n = 0; n < kHeads; ++n) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) merge.acc[warp][n][lane * CPL + i] = acc[n][i];
    if (lane == 0) {
      merge.m[warp][n] = m[n];
      merge.l[warp][n] = l[n];
    }
  }
}

// (.., 3): at most 168 registers, the 3 blocks per SM the design counts on; with no minimum ptxas
// chose 96 registers and spilled 4 bytes in the D = 64, k2/v4, paged variant. D = 256 holds twice
// the accumulators (64 MMA registers, 128 in the tail) and spilled ~150 bytes at 168: 2 blocks.
template <int D, int KB, int VB, bool PAGED, typename T>
__global__ void __launch_bounds__(kWarps * 32, D == 256 ? 2 : 3) decode_split_kernel(const DecodeParams p) {
  __shared__ __align__(16) float q_s[kHeads][D];
  __shared__ __align__(16) float p_s[kWarps][kHeads][kPStride];
  __shared__ Merge<D> merge;  // with q_s and p_s: 45 KB at D = 256, under the 48 KB of static shared memory
  extern __shared__ __align__(16) uint8_t ring[];  // Stage<D, KB, VB>::kRing bytes (0: no ring), then kQ16Bytes
  uint16_t(*q16)[D] = reinterpret_cast<uint16_t(*)[D]>(ring + Stage<D, KB, VB>::kRing);  // kMagicKeys: q in 16 bits
  // Query-head tiles: more than 8 query heads per kv head (the MMA's N) take ceil(qg / 8) blocks,
  // each its 8 heads [head0, head0 + heads); the tiles of a kv row are adjacent in x, so they read
  // the same codes at about the same time (the second read mostly from L2).
  const int tiles = (p.qg + kHeads - 1) / kHeads, kv_row = blockIdx.x / tiles;
  const int b = kv_row / p.kv_heads, h = kv_row % p.kv_heads, split = blockIdx.y;
  const int head0 = (blockIdx.x % tiles) * kHeads, heads = min(kHeads, p.qg - head0);
  const int warp = threadIdx.x / 32;
  for (int i = threadIdx.x; i < kHeads * D; i += blockDim.x) {  // heads past the tile's: zero queries, never written
    const int n = i / D, ch = i % D;
    const size_t row = (static_cast<size_t>(b) * p.kv_heads + h) * p.qg + head0 + n;
    const float q = n < heads ? Num<T>::to_float(reinterpret_cast<const T*>(p.q)[row * D + ch]) * p.qscale : 0.f;
    q_s[n][ch] = q;
    if constexpr (kMagicKeys) q16[n][q16_slot(ch)] = bits_of(Num<T>::from_float(q));
  }
  __syncthreads();
  const RowCounts rc = row_counts(p, b);
  if (split < p.num_splits) {
    // the chunks the splits share: the fully quantized ones, and with the residual in the loop every
    // chunk the row touches
    const int chunks = kResidualInLoop ? (rc.length + kChunk - 1) / kChunk : rc.chunks;
    const int per = (chunks + p.num_splits - 1) / p.num_splits;
    const int begin = split * per, end = min(begin + per, chunks);
    uint8_t* warp_ring = ring + warp * Stage<D, KB, VB>::kStagesBuilt * Stage<D, KB, VB>::kBytes;
    warp_chunks<D, KB, VB, PAGED, T>(p, q_s, q16, p_s[warp], merge, warp_ring, b, h, begin + warp, min(end, rc.chunks), end,
                                     rc);
  } else {
    tail_tokens<D, KB, VB, PAGED, T>(p, q_s, merge, b, h, rc.chunks * kChunk + warp, rc, heads);
  }
  __syncthreads();
  // Merge the warps: (max, sum, acc) of each query head for this split.
  for (int i = threadIdx.x; i < heads * D; i += blockDim.x) {
    const int n = i / D, ch = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, merge.m[w][n]);
    float a = 0.f, l = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = fast_exp2(merge.m[w][n] - M);
        a += f * merge.acc[w][n][ch];
        l += f * merge.l[w][n];
      }
    }
    const size_t row = (static_cast<size_t>(b) * p.kv_heads + h) * p.qg + head0 + n;
    const size_t slot = row * (p.num_splits + 1) + split;
    p.part_acc[slot * D + ch] = a;
    if (ch == 0) {
      p.part_ml[2 * slot] = M;
      p.part_ml[2 * slot + 1] = l;
    }
  }
}

// One block per query row, one thread per channel: the splits' softmax merge, saturated to T's range.
template <typename T>
__global__ void decode_merge_kernel(const DecodeParams p) {
  const size_t row = blockIdx.x;
  const int ch = threadIdx.x, splits = p.num_splits + kTailSplits, stride = p.num_splits + 1;
  const float* ml = p.part_ml + row * stride * 2;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ml[2 * s]);
  float a = 0.f, l = 0.f;
  if (M != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      const float f = fast_exp2(ml[2 * s] - M);
      a += f * p.part_acc[(row * stride + s) * p.head_dim + ch];
      l += f * ml[2 * s + 1];
    }
  }
  const float o = l > 0.f ? fminf(fmaxf(a / l, -Num<T>::kMax), Num<T>::kMax) : 0.f;
  reinterpret_cast<T*>(p.out)[row * p.head_dim + ch] = Num<T>::from_float(o);
}


// The split kernel for (head_dim, key bits, value bits, paged, element type) and its dynamic shared
// memory; kernel nullptr for what is not built.
struct SplitKernel {
  void (*kernel)(DecodeParams);
  int ring_bytes;
};

template <int D, int KB, int VB, typename T>
SplitKernel split_kernel_of(bool paged) {
  return {paged ? decode_split_kernel<D, KB, VB, true, T> : decode_split_kernel<D, KB, VB, false, T>,
          Stage<D, KB, VB>::kRing + kQ16Bytes<D>};
}

template <int D, typename T>
SplitKernel split_kernel(const DecodeParams& p) {
  const bool paged = p.block_table != nullptr;
  switch (p.k_bits * 10 + p.v_bits) {
    case 22: return split_kernel_of<D, 2, 2, T>(paged);
    case 24: return split_kernel_of<D, 2, 4, T>(paged);
    case 42: return split_kernel_of<D, 4, 2, T>(paged);
    case 44: return split_kernel_of<D, 4, 4, T>(paged);
    default: return {nullptr, 0};
  }
}

template <typename T>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.batch * p.kv_heads * ((p.qg + kHeads - 1) / kHeads), p.num_splits + kTailSplits);
  const SplitKernel k = p.head_dim == 128   ? split_kernel<128, T>(p)
                        : p.head_dim == 64  ? split_kernel<64, T>(p)
                        : p.head_dim == 256 ? split_kernel<256, T>(p)
                                            : SplitKernel{nullptr, 0};
  if (k.kernel == nullptr) return cudaErrorInvalidValue;
  if (k.ring_bytes > 0) {  // a ring past 48 KB of dynamic shared memory needs the opt-in
    cudaError_t err = cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.ring_bytes);
    if (err != cudaSuccess) return err;
  }
  k.kernel<<<grid, kWarps * 32, k.ring_bytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  decode_merge_kernel<T><<<p.batch * p.kv_heads * p.qg, p.head_dim, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_decode_attend(const DecodeParams& p, cudaStream_t stream) {
  return p.bf16 ? launch<__nv_bfloat16>(p, stream) : launch<__half>(p, stream);
}

}  // namespace kivi_cuda

// C entry point for a shared library built by plain nvcc (loader.py's prebuilt route: no torch
// header and no compiler on the GPU machine); returns the cudaError_t as an int.
extern "C" int kivi_decode_attend_launch(const kivi_cuda::DecodeParams* p, cudaStream_t stream) {
  return static_cast<int>(kivi_cuda::launch_decode_attend(*p, stream));
}

// The variant this library was built as: (stages asked, residual in the loop, blocks per SM the
// splits are sized for, the 16-bit fold); prebuilt.py reads it.
extern "C" void kivi_decode_variant(int* stages, int* residual_in_loop, int* blocks_per_sm, int* fold16) {
  *fold16 = KIVI_DECODE_FOLD16;
  *stages = KIVI_DECODE_STAGES;
  *residual_in_loop = KIVI_DECODE_RESIDUAL_IN_LOOP;
  *blocks_per_sm = KIVI_DECODE_BLOCKS_PER_SM;
}
