// torch binding of the CUDA decode kernel (decode_attend.cu): checks the tensors, allocates the
// split workspace and the output, launches on the current stream. Built only by
// torch.utils.cpp_extension (loader.py) on a machine with a CUDA build of torch.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "decode_attend.h"

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "kivi cuda decode: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "kivi cuda decode: ", name, " has dtype ", t.scalar_type(), ", expected ",
              dtype);
  TORCH_CHECK(t.is_contiguous(), "kivi cuda decode: ", name, " must be contiguous");
}

torch::Tensor decode_attend(torch::Tensor query, torch::Tensor k_codes, torch::Tensor k_scale, torch::Tensor k_zero,
                            torch::Tensor k_res, torch::Tensor v_codes, torch::Tensor v_scale, torch::Tensor v_zero,
                            torch::Tensor v_res, torch::Tensor lengths, c10::optional<torch::Tensor> counts,
                            int64_t group_size, int64_t residual_length, int64_t ott_policy, double scale,
                            int64_t num_splits, c10::optional<torch::Tensor> block_table) {
  // fp16 or bf16 (the query's dtype): every 16-bit tensor must match it
  const auto half = query.scalar_type();
  TORCH_CHECK(half == torch::kHalf || half == torch::kBFloat16, "kivi cuda decode: query dtype must be float16 or "
              "bfloat16, got ", half);
  check(query, "query", half);
  check(k_codes, "k_codes", torch::kUInt8);
  check(v_codes, "v_codes", torch::kUInt8);
  for (auto& [t, name] : {std::pair{&k_scale, "k_scale"}, {&k_zero, "k_zero"}, {&k_res, "k_res"},
                          {&v_scale, "v_scale"}, {&v_zero, "v_zero"}, {&v_res, "v_res"}}) {
    check(*t, name, half);
  }
  check(lengths, "lengths", torch::kLong);
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "kivi cuda decode: query must be [B, Hq, 1, D]");
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(3);
  // Paged (block_table given): k_codes is the page pool [pages, H, page_size, D/4].
  const int64_t H = k_codes.size(1), rows = k_codes.size(2);
  const int64_t S = block_table.has_value() ? block_table->size(1) * rows : rows;
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "kivi cuda decode: head_dim must be 64, 128 or 256, got ", D);
  const int64_t k_bits = k_codes.size(3) * 8 / D, v_bits = v_codes.size(3) * 8 / D;
  TORCH_CHECK((k_bits == 2 || k_bits == 4) && (v_bits == 2 || v_bits == 4) && k_codes.size(3) * 8 == k_bits * D &&
                  v_codes.size(3) * 8 == v_bits * D,
              "kivi cuda decode: 2- or 4-bit keys and values only, got code rows of ", k_codes.size(3), " and ",
              v_codes.size(3), " bytes at head_dim ", D);
  TORCH_CHECK(Hq % H == 0 && Hq / H <= 16, "kivi cuda decode: at most 16 query heads per kv head, got ", Hq, "/", H);
  TORCH_CHECK(group_size % 32 == 0, "kivi cuda decode: group_size must be a multiple of 32, got ", group_size);
  TORCH_CHECK(num_splits >= 1, "kivi cuda decode: num_splits must be >= 1");
  if (counts.has_value()) check(*counts, "counts", torch::kLong);
  if (block_table.has_value()) {
    check(*block_table, "block_table", torch::kInt);
    TORCH_CHECK(block_table->dim() == 2 && block_table->size(0) == B, "kivi cuda decode: block_table must be [", B,
                ", max_pages]");
    TORCH_CHECK(rows % group_size == 0, "kivi cuda decode: page_size ", rows, " must be a multiple of group_size");
  }

  const c10::cuda::CUDAGuard guard(query.device());
  auto f32 = query.options().dtype(torch::kFloat);
  auto part_acc = torch::empty({B * Hq, num_splits + 1, D}, f32);
  auto part_ml = torch::empty({B * Hq, num_splits + 1, 2}, f32);
  auto out = torch::empty_like(query);
  if (B == 0) return out;

  kivi_cuda::DecodeParams p{};
  p.q = reinterpret_cast<const __half*>(query.data_ptr());
  p.k_codes = k_codes.data_ptr<uint8_t>();
  p.k_scale = reinterpret_cast<const __half*>(k_scale.data_ptr());
  p.k_zero = reinterpret_cast<const __half*>(k_zero.data_ptr());
  p.k_res = reinterpret_cast<const __half*>(k_res.data_ptr());
  p.v_codes = v_codes.data_ptr<uint8_t>();
  p.v_scale = reinterpret_cast<const __half*>(v_scale.data_ptr());
  p.v_zero = reinterpret_cast<const __half*>(v_zero.data_ptr());
  p.v_res = reinterpret_cast<const __half*>(v_res.data_ptr());
  p.lengths = lengths.data_ptr<int64_t>();
  p.counts = counts.has_value() ? counts->data_ptr<int64_t>() : nullptr;
  p.part_acc = part_acc.data_ptr<float>();
  p.part_ml = part_ml.data_ptr<float>();
  p.out = reinterpret_cast<__half*>(out.data_ptr());  // bf16 bits when p.bf16
  p.block_table = block_table.has_value() ? block_table->data_ptr<int32_t>() : nullptr;
  p.max_pages = block_table.has_value() ? block_table->size(1) : 0;
  p.page_size = block_table.has_value() ? rows : 0;
  p.num_pages = block_table.has_value() ? k_codes.size(0) : 0;
  p.k_bits = k_bits;
  p.v_bits = v_bits;
  p.batch = B;
  p.kv_heads = H;
  p.qg = Hq / H;
  p.max_tokens = S;
  p.slots = k_res.size(2);
  p.residual = residual_length;
  p.group = group_size;
  p.head_dim = D;
  p.num_splits = num_splits;
  p.ott_policy = ott_policy;
  p.qscale = static_cast<float>(scale * 1.4426950408889634);  // log2(e): base-2 softmax
  p.bf16 = half == torch::kBFloat16;
  const cudaError_t err = kivi_cuda::launch_decode_attend(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "kivi cuda decode: launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attend", &decode_attend, "KIVI decode attention on tensor cores (decode_attend.cu)");
  m.def("variant", [] {
    int stages, residual_in_loop, blocks_per_sm, fold16;
    kivi_decode_variant(&stages, &residual_in_loop, &blocks_per_sm, &fold16);
    return std::make_tuple(stages, residual_in_loop, blocks_per_sm, fold16);
  }, "(stages, residual in the loop, blocks per SM, 16-bit fold) the kernel was compiled as (decode_attend.cu's variants)");
}
