// furcate::block_gemv's CPU kernel in C++: what block_gemv.py's gemv() does, without the trip into Python a
// compiled decode step would otherwise make for each quantized layer (~8 us a call).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "block_gemv.h"

namespace {

constexpr int64_t kRows = ROWS, kPair = PAIR, kLaneFloats = LANE_FLOATS;

int64_t packed_bytes(int64_t n, int64_t k, int64_t bits, bool symmetric) {
  return (n + kRows - 1) / kRows * kRows * (k / kPair) * (8 * bits + (symmetric ? 4 : 8));
}

// A reusable buffer per thread for the quantized activations and their lanes (as block_gemv.py's scratch()).
uint8_t* scratch(int64_t nbytes) {
  thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < nbytes) {
    buffer = at::empty({std::max<int64_t>(nbytes, 1 << 16)}, at::kByte);
  }
  return buffer.data_ptr<uint8_t>();
}

at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& weight, int64_t n, int64_t bits, bool symmetric) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
                    "block GEMV takes float32 or bfloat16 activations [M, K], not ", x_in.scalar_type(), " ",
                    x_in.sizes());
  TORCH_CHECK_VALUE((bits == 4 || bits == 8) && n > 0 && x_in.size(1) % kPair == 0 && weight.is_contiguous() &&
                        weight.scalar_type() == at::kByte,
                    "block GEMV takes 4- or 8-bit packed rows of a multiple of ", kPair, " weights");
  auto x = x_in.contiguous();
  int64_t m = x.size(0), k = x.size(1);
  int64_t expected = packed_bytes(n, k, bits, symmetric);
  TORCH_CHECK_VALUE(weight.numel() == expected, "block GEMV weights hold ", weight.numel(), " bytes, not the ",
                    expected, " of ", n, " rows of ", k, " ", bits, "-bit weights (weights released?)");
  auto out = at::empty({m, n}, x.options());
  uint8_t* activations = scratch(2 * m * k + 8 * m * (k / kPair) * kLaneFloats);
  bool bf16 = x.scalar_type() == at::kBFloat16;
  BlockGemvArgs args{};
  args.x = x.data_ptr();
  args.x_bf16 = bf16;
  args.M = static_cast<int>(m);
  args.K = static_cast<int>(k);
  args.N = static_cast<int>(n);
  args.w = weight.data_ptr<uint8_t>();
  args.bits = static_cast<int>(bits);
  args.symmetric = symmetric;
  args.out = out.data_ptr();
  args.out_bf16 = bf16;
  args.scratch = reinterpret_cast<int8_t*>(activations);
  args.lane_scratch = reinterpret_cast<float*>(activations + 2 * m * k);
  args.threads = at::get_num_threads();
  block_gemv(&args);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(furcate, CPU, m) {
  m.impl("block_gemv", &gemv);
}
