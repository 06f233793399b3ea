// Writing a forward's new keys and values into the paged pool on CPU (the "cpu" backend):
// both tensors in one call, read where they lie (the strided [N, Hkv, D] views a layer's
// [1, Hkv, N, D] projections give once transposed), copied head by head.
//
//   k/v_cache     [NB, bs, Hkv, D]  the layer's pool views (strided over layers; each head
//                 contiguous), the dtype of key and value
//   key, value    [N, Hkv, D]       any strides with contiguous heads
//   slot_mapping  [N] int64         flat slot (block * bs + offset) of each new token
//
// Two index_copy_ calls did the same through the dispatcher, each costing more than the
// copy itself at decode sizes.

#include <torch/extension.h>

#include <cstring>

namespace {

void write_one(const torch::Tensor& cache, const torch::Tensor& src, const int64_t* slots,
               int64_t n) {
  const int64_t bs = cache.size(1), heads = cache.size(2), dim = cache.size(3);
  const int64_t cb = cache.stride(0), ct = cache.stride(1), ch = cache.stride(2);
  const int64_t st = src.stride(0), sh = src.stride(1);
  const int64_t item = cache.element_size(), bytes = dim * item;
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    char* row = dst + ((slot / bs) * cb + (slot % bs) * ct) * item;
    const char* token = from + i * st * item;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(row + h * ch * item, token + h * sh * item, bytes);
    }
  }
}

void check(const torch::Tensor& cache, const torch::Tensor& src, const char* what) {
  TORCH_CHECK(cache.dim() == 4 && src.dim() == 3, "write_kv: ", what,
              ": cache [NB, bs, Hkv, D] and new tokens [N, Hkv, D] expected");
  TORCH_CHECK(src.size(1) == cache.size(2) && src.size(2) == cache.size(3), "write_kv: ",
              what, ": the new tokens' heads do not match the cache's");
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), "write_kv: ", what,
              ": the new tokens must have the cache's dtype");
  TORCH_CHECK(cache.stride(3) == 1 && src.stride(2) == 1, "write_kv: ", what,
              ": each head must be contiguous");
}

}  // namespace

void cpu_write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key,
                  torch::Tensor value, torch::Tensor slot_mapping) {
  check(k_cache, key, "keys");
  check(v_cache, value, "values");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0) &&
                  value.size(0) == key.size(0),
              "write_kv: one contiguous int64 slot per new token expected");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t limit = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
              "write_kv: keys and values must have the same blocks");
  for (int64_t i = 0; i < slot_mapping.size(0); ++i) {  // all checked before any is written
    TORCH_CHECK(slots[i] >= 0 && slots[i] < limit, "write_kv: slot ", slots[i], " of token ",
                i, " is outside the pool's ", limit, " slots");
  }
  write_one(k_cache, key, slots, key.size(0));
  write_one(v_cache, value, slots, value.size(0));
}
