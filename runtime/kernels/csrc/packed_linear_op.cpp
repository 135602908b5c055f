// furcate::packed_linear's CPU kernel in C++, so that a compiled decode step calls it without a trip into Python
// (about 8 us a call there, ~1 ms of a 9 ms batch-1 step over the default model's 121 linears).
//
// A layer's oneDNN-packed copy is found by its weight: packed_register(parameter, packed, from_rows, gemv) files
// the copy (none for a float32 layer that packs from no row but runs one row through the dense GEMV) under the
// weight's address. Both are held weakly, so a layer that drops its copy, or is freed, leaves a stale entry that
// is never served (and is swept at the next registration); a weight replaced since it registered runs at::linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Packed {
  WeakTensor weight;  // the layer's parameter, which owns the weight it packed
  WeakTensor packed;  // the layer holds the copy; this entry only points at it
  bool has_packed;  // whether the layer keeps a copy at all (one that serves only the GEMV does not)
  int64_t from_rows;  // rows from which the packed copy serves
  bool gemv;  // whether one row runs dense_gemv instead
};

// What serves a weight: its packed copy from `from_rows` rows on (undefined: none), dense_gemv at one row or not.
struct Served {
  at::Tensor packed;
  int64_t from_rows = 0;
  bool gemv = false;
};

std::mutex registry_lock;
std::unordered_map<const void*, Packed> registry;  // keyed by the weight's data address

void sweep_stale() {
  for (auto it = registry.begin(); it != registry.end();) {
    bool gone = it->second.weight.expired() || (it->second.has_packed && it->second.packed.expired());
    it = gone ? registry.erase(it) : std::next(it);
  }
}

void packed_register(const at::Tensor& weight, const std::optional<at::Tensor>& packed, int64_t from_rows,
                     bool gemv) {
  std::lock_guard<std::mutex> guard(registry_lock);
  sweep_stale();
  bool has_packed = packed.has_value() && packed->defined();
  // without a copy the entry's `packed` is never read: the weight stands in for it
  WeakTensor copy(has_packed ? packed->getIntrusivePtr() : weight.getIntrusivePtr());
  registry.insert_or_assign(weight.data_ptr(), Packed{WeakTensor(weight.getIntrusivePtr()), copy, has_packed,
                                                      from_rows, gemv});
}

// Whether `weight` is the registered parameter's data as it is now: the same storage (held alive by the locked
// parameter, so its address cannot have been reused), address and shape.
bool same_weight(const at::Tensor& weight, const at::Tensor& registered) {
  return registered.defined() && registered.data_ptr() == weight.data_ptr() &&
         registered.storage().unsafeGetStorageImpl() == weight.storage().unsafeGetStorageImpl() &&
         registered.sizes() == weight.sizes();
}

// What serves this weight; nothing where none is registered, its layer dropped its copy (and takes no GEMV), or
// the weight is not the one that registered.
Served lookup(const at::Tensor& weight) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(weight.data_ptr());
  if (found == registry.end() || !same_weight(weight, at::Tensor(found->second.weight.lock()))) {
    return Served{};
  }
  const Packed& entry = found->second;
  at::Tensor packed = entry.has_packed ? at::Tensor(entry.packed.lock()) : at::Tensor();
  return packed.defined() || entry.gemv ? Served{packed, entry.from_rows, entry.gemv} : Served{};
}

at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// Dense GEMV for one row: each weight row is one contiguous stream, read once, and the work starts at once.
// oneDNN's packed linear reads a blocked copy at the same speed once it runs, but costs ~8-13 us a call before
// it does (121 calls a step on the default model). Built for what the CPU has: float32 with AVX512F, else with
// AVX2 and FMA (the CPUs most people have), bfloat16 with AVX512-BF16 (its dot product accumulates in float32;
// the sum is rounded once, to nearest even).
#if defined(__AVX512F__)
void gemv_rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // four chains hide the FMA's latency
    for (int64_t k = 0; k < K; k += 64) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(row + k), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(row + k + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), _mm512_loadu_ps(row + k + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), _mm512_loadu_ps(row + k + 48), a3);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    y[n] = bias ? sum + bias[n] : sum;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMV_FLOAT32 1
float reduce_add(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

void gemv_rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* row = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // four chains hide the FMA's latency
    for (int64_t k = 0; k < K; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(row + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(row + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(row + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(row + k + 24), a3);
    }
    float sum = reduce_add(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    y[n] = bias ? sum + bias[n] : sum;
  }
}
#endif
#if defined(__AVX512F__)
#define GEMV_FLOAT32 1
#endif

#if defined(__AVX512BF16__)
void gemv_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y, int64_t K,
               int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (int64_t k = 0; k < K; k += 64) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(row + k));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32),
                            (__m512bh)_mm512_loadu_si512(row + k + 32));
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    y[n] = at::BFloat16(bias ? sum + static_cast<float>(bias[n]) : sum);
  }
}
#endif

bool gemv_built(at::ScalarType dtype) {
#if defined(GEMV_FLOAT32)
  if (dtype == at::kFloat) return true;
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

// Whether dense_gemv takes x (one row, [..., K]) times weight [N, K] plus bias [N]: all contiguous, of one dtype
// it is built for, K a multiple of 64.
bool gemv_serves(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  auto dtype = x.scalar_type();
  bool bias_fits = !bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                                         bias->is_contiguous() && bias->scalar_type() == dtype);
  return weight.dim() == 2 && x.dim() >= 1 && x.numel() == weight.size(1) && weight.size(1) % 64 == 0 &&
         x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == dtype && bias_fits &&
         gemv_built(dtype);
}

template <typename T>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  int64_t n = weight.size(0), k = weight.size(1);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  const T *xp = x.data_ptr<T>(), *wp = weight.data_ptr<T>(), *bp = bias ? bias->data_ptr<T>() : nullptr;
  T* yp = out.data_ptr<T>();
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) { gemv_rows(xp, wp, bp, yp, k, n0, n1); });
  return out;
}

at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(gemv_serves(x, weight, bias), "dense GEMV takes one contiguous row times a contiguous [N, K] "
                    "weight (and bias [N]) of one dtype (float32 with AVX512F or AVX2, bfloat16 with AVX512-BF16), K a "
                    "multiple of 64; not ", x.scalar_type(), " ", x.sizes(), " times ", weight.scalar_type(), " ",
                    weight.sizes());
#if defined(GEMV_FLOAT32)
  if (x.scalar_type() == at::kFloat) return gemv<float>(x, weight, bias);
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return gemv<at::BFloat16>(x, weight, bias);
#endif
  TORCH_CHECK(false, "unreachable: gemv_serves admitted a dtype without a build");
}

bool dense_gemv_built(c10::ScalarType dtype) { return gemv_built(dtype); }

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  int64_t width = x.size(-1), rows = width ? x.numel() / width : 0;
  Served served = lookup(weight);
  if (served.gemv && rows == 1 && gemv_serves(x, weight, bias)) {
    return dense_gemv(x, weight, bias);
  }
  return served.packed.defined() && rows >= served.from_rows ? linear_pointwise(x, served.packed, bias)
                                                             : at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(furcate, m) {
  m.def("packed_register(Tensor weight, Tensor? packed, int from_rows, bool gemv) -> ()", &packed_register);
  m.def("dense_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &dense_gemv);
  m.def("dense_gemv_built(ScalarType dtype) -> bool", &dense_gemv_built);
}

TORCH_LIBRARY_IMPL(furcate, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
