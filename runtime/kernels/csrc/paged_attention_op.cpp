// furcate::paged_attention's CPU kernel in C++: the arguments paged_attention.py's attention() passes, without
// the trip into Python a compiled decode step would otherwise make for each layer (~15 us a call). The status texts
// are paged_attention.py's ERRORS (tests/test_native_sources.py checks that they agree).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>

#include "paged_attention.h"

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
  PagedAttentionArgs args{};
  args.q = q.data_ptr();
  args.k_pool = k_pool.data_ptr();
  args.v_pool = v_pool.data_ptr();
  args.pool_slots = k_pool.size(0);
  args.slots = kv_index.data_ptr<int64_t>();
  args.table_len = kv_index.size(1);
  args.spans = spans.data_ptr<int64_t>();
  args.batch = static_cast<int>(spans.size(1));
  args.heads = static_cast<int>(q.size(1));
  args.kv_heads = static_cast<int>(k_pool.size(1));
  args.dim = static_cast<int>(q.size(2));
  args.scale = static_cast<float>(scale);
  args.out = out.data_ptr();
  args.threads = at::get_num_threads();
  args.bf16 = dtype == at::kBFloat16;
  int status = paged_attention(&args);
  TORCH_CHECK_VALUE(status == 0, "paged attention: ", reason(status), " (up to ", MAX_GROUP, " query heads per KV "
                    "head and head_dim ", MAX_DIM, ", a multiple of ", LANES, "; here ", args.heads, "/",
                    args.kv_heads, " heads of ", args.dim, ")");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(furcate, CPU, m) {
  m.impl("paged_attention", &attention);
}
