// furcate::packed_linear's CPU kernel in C++, so that a compiled decode step calls it without a trip into Python
// (about 8 us a call there, ~1 ms of a 9 ms batch-1 step over the default model's 121 linears).
//
// A layer's oneDNN-packed copy is found by its weight: packed_register(parameter, packed, from_rows) files the copy
// under the weight's address. Both are held weakly, so a layer that drops its copy, or is freed, leaves a stale
// entry that is never served (and is swept at the next registration); a weight replaced since it packed runs
// at::linear.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Packed {
  WeakTensor weight;  // the layer's parameter, which owns the weight it packed
  WeakTensor packed;  // the layer holds the copy; this entry only points at it
  int64_t from_rows;
};

std::mutex registry_lock;
std::unordered_map<const void*, Packed> registry;  // keyed by the weight's data address

void sweep_stale() {
  for (auto it = registry.begin(); it != registry.end();) {
    it = it->second.packed.expired() || it->second.weight.expired() ? registry.erase(it) : std::next(it);
  }
}

void packed_register(const at::Tensor& weight, const at::Tensor& packed, int64_t from_rows) {
  std::lock_guard<std::mutex> guard(registry_lock);
  sweep_stale();
  registry.insert_or_assign(weight.data_ptr(), Packed{WeakTensor(weight.getIntrusivePtr()),
                                                      WeakTensor(packed.getIntrusivePtr()), from_rows});
}

// Whether `weight` is the registered parameter's data as it is now: the same storage (held alive by the locked
// parameter, so its address cannot have been reused), address and shape.
bool same_weight(const at::Tensor& weight, const at::Tensor& registered) {
  return registered.defined() && registered.data_ptr() == weight.data_ptr() &&
         registered.storage().unsafeGetStorageImpl() == weight.storage().unsafeGetStorageImpl() &&
         registered.sizes() == weight.sizes();
}

// The packed copy serving this weight at this many rows, or an undefined tensor: none registered, its layer
// dropped it, the weight is not the one that packed, or the rows are below the layer's crossover.
at::Tensor lookup(const at::Tensor& weight, int64_t rows) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(weight.data_ptr());
  if (found == registry.end() || rows < found->second.from_rows ||
      !same_weight(weight, at::Tensor(found->second.weight.lock()))) {
    return at::Tensor();
  }
  return at::Tensor(found->second.packed.lock());
}

at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  int64_t width = x.size(-1);
  at::Tensor packed = lookup(weight, width ? x.numel() / width : 0);
  return packed.defined() ? linear_pointwise(x, packed, bias) : at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(furcate, m) {
  m.def("packed_register(Tensor weight, Tensor packed, int from_rows) -> ()", &packed_register);
}

TORCH_LIBRARY_IMPL(furcate, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
