// furcate::paged_attention's CPU kernel in C++: the arguments paged_attention.py's attention() passes, without
// the trip into Python a compiled decode step would otherwise make for each layer (~15 us a call).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>

extern "C" int paged_attention(const void* q, const void* k_pool, const void* v_pool, int64_t pool_slots,
                               const int64_t* slots, int64_t table_len, const int64_t* spans, int batch, int heads,
                               int kv_heads, int dim, float scale, void* out, int threads, int bf16);

namespace {

const char* reason(int status) {
  switch (status) {
    case -1: return "shapes beyond the kernel's limits";
    case -2: return "a request's tokens run past its slot table";
    default: return "out of memory";
  }
}

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& kv_index_in, const at::Tensor& spans_in, double scale) {
  auto dtype = q_in.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16) && k_pool.scalar_type() == dtype &&
                        v_pool.scalar_type() == dtype,
                    "paged attention runs float32 or bfloat16, not ", dtype, " queries over a ",
                    k_pool.scalar_type(), "/", v_pool.scalar_type(), " pool");
  TORCH_CHECK_VALUE(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() &&
                        k_pool.is_contiguous() && v_pool.is_contiguous() && kv_index_in.dim() == 2 &&
                        spans_in.dim() == 2 && spans_in.size(0) == 3 &&
                        kv_index_in.scalar_type() == at::kLong && spans_in.scalar_type() == at::kLong,
                    "paged attention takes q [T, H, D], contiguous pools [slots, Hkv, D], int64 kv_index [B, L] "
                    "and spans [3, B]");
  auto q = q_in.contiguous(), kv_index = kv_index_in.contiguous(), spans = spans_in.contiguous();
  auto out = at::empty_like(q);
  int heads = q.size(1), kv_heads = k_pool.size(1), dim = q.size(2);
  int status = paged_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.size(0),
                               kv_index.data_ptr<int64_t>(), kv_index.size(1), spans.data_ptr<int64_t>(),
                               spans.size(1), heads, kv_heads, dim, static_cast<float>(scale), out.data_ptr(),
                               at::get_num_threads(), dtype == at::kBFloat16);
  TORCH_CHECK_VALUE(status == 0, "paged attention: ", reason(status), " (up to 16 query heads per KV head and "
                    "head_dim 256, a multiple of 16; here ", heads, "/", kv_heads, " heads of ", dim, ")");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(furcate, CPU, m) {
  m.impl("paged_attention", &attention);
}
