// KIVI decode attention on tensor cores: the launch parameters shared by the CUDA file and the
// torch binding. No torch header here, so decode_attend.cu compiles with plain nvcc (ptxas
// reports and SASS without a CUDA build of torch: lab/cuda_decode_model.py).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace kivi_cuda {

// Every cache tensor contiguous (the __half pointers hold bf16 bits when bf16 is set), in kivi_ops/layout.py's shapes (B batch, H kv heads, S max tokens,
// D head_dim, W residual slots, Gv = min(G, D) value group); the query is [B, H * qg, D].
struct DecodeParams {
  const __half* q;
  const uint8_t* k_codes;   // [B, H, S, D * k_bits / 8]
  const __half* k_scale;    // [B, H, ceil(S/G), D]
  const __half* k_zero;
  const __half* k_res;      // [B, H, W, D]
  const uint8_t* v_codes;   // [B, H, S, D * v_bits / 8]
  const __half* v_scale;    // [B, H, S, D/Gv]
  const __half* v_zero;
  const __half* v_res;      // [B, H, W, D]
  const int64_t* lengths;   // [B]
  const int64_t* counts;    // [B] or nullptr: a row with count 0 is padding and returns zeros
  float* part_acc;          // [B, H * qg, num_splits + 1, D]: unnormalized output per split
  float* part_ml;           // [B, H * qg, num_splits + 1, 2]: (max, sum) per split, base 2
  __half* out;              // [B, H * qg, D]
  // Paged layer (kivi_ops/paged_layout.py) or nullptr (static): the block table [B, max_pages];
  // the code and scale buffers above are then page pools [num_pages, H, page_size (/G for
  // k_scale/k_zero), ...] and max_tokens = max_pages * page_size. Ids are clamped into the pool.
  const int32_t* block_table;
  int batch, kv_heads, qg, max_tokens, slots, residual, group, head_dim, num_splits, ott_policy;
  int max_pages, page_size, num_pages;
  int k_bits, v_bits;       // 2 or 4 each: the codes' widths (k_codes [.., D * k_bits / 8])
  float qscale;             // softmax scale * log2(e): scores are in base 2
  int bf16;                 // 0: the 16-bit buffers (q, scales, zeros, residuals, out) are fp16; 1: bf16
};

// Launches the split kernel (num_splits quantized splits + 1 tail split per (row, kv head)) and the
// merge kernel on `stream`. Returns cudaSuccess or the launch error (cudaErrorInvalidValue for a
// head_dim other than 64/128/256 or bits other than 2/4). bf16 selects the bf16 kernels.
cudaError_t launch_decode_attend(const DecodeParams& p, cudaStream_t stream);

}  // namespace kivi_cuda

// The compile-time variant the kernel was built as (decode_attend.cu: KIVI_DECODE_STAGES,
// KIVI_DECODE_RESIDUAL_IN_LOOP, KIVI_DECODE_BLOCKS_PER_SM, KIVI_DECODE_FOLD16).
extern "C" void kivi_decode_variant(int* stages, int* residual_in_loop, int* blocks_per_sm, int* fold16);
