// Rotary position embedding of queries and keys in one pass (CPU, float32): Transformers'
// Llama `apply_rotary_pos_emb`, which spends about fourteen small ops per layer (slices,
// negations, concatenations, products and sums) where one pass over q and k suffices.
//
//   q [B, Hq, N, D], k [B, Hk, N, D] float32, any strides but a contiguous last dim
//   cos, sin [B, N, D] float32, contiguous last dim (the layer's cos[position], sin[position])
//   -> (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin), laid out as q and k
//      (rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]); D even), or None for other inputs
//
// Bit for bit the values of Transformers' ops: each product is rounded to float32 before
// the sum, so no multiply-add may be fused (contraction is off below), and the rotated
// half is negated before its product as rotate_half does.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <optional>
#include <tuple>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

// out[b, h, n] = x[b, h, n] * cos[b, n] + rotate_half(x[b, h, n]) * sin[b, n], every (b, h, n).
void rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
            torch::Tensor& out) {
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3);
  const int64_t half = dim / 2;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xn = x.stride(2);
  const int64_t ob = out.stride(0), oh = out.stride(1), on = out.stride(2);
  const int64_t cb = cos.stride(0), cn = cos.stride(1), sb = sin.stride(0), sn = sin.stride(1);
  // Threads only for prefills: a decode step's few thousand values take less than waking them.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, batch * tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t bn = begin; bn < end; ++bn) {
      const int64_t b = bn / tokens, n = bn % tokens;
      const float* c = cp + b * cb + n * cn;
      const float* s = sp + b * sb + n * sn;
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + b * xb + h * xh + n * xn;
        float* o = op + b * ob + h * oh + n * on;
        for (int64_t i = 0; i < half; ++i) {
          const float straight = in[i] * c[i];
          const float rotated = -in[i + half] * s[i];
          o[i] = straight + rotated;
        }
        for (int64_t i = half; i < dim; ++i) {
          const float straight = in[i] * c[i];
          const float rotated = in[i - half] * s[i];
          o[i] = straight + rotated;
        }
      }
    }
  });
}

}  // namespace

// None (nothing computed) where the kernel does not serve: other shapes or dtypes, tensors off
// the CPU; the caller then runs Transformers' ops.
std::optional<std::tuple<torch::Tensor, torch::Tensor>> cpu_rotary(
    torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  if (q.dim() != 4 || k.dim() != 4 || cos.dim() != 3 || cos.sizes() != sin.sizes()) {
    return std::nullopt;
  }
  const int64_t batch = cos.size(0), tokens = cos.size(1), dim = cos.size(2);
  for (const auto* t : {&q, &k, &cos, &sin}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->stride(-1) != 1) {
      return std::nullopt;
    }
  }
  if (dim % 2 || q.size(0) != batch || k.size(0) != batch || q.size(2) != tokens ||
      k.size(2) != tokens || q.size(3) != dim || k.size(3) != dim) {
    return std::nullopt;
  }
  auto q_out = at::empty_like(q);
  auto k_out = at::empty_like(k);
  rotate(q, cos, sin, q_out);
  rotate(k, cos, sin, k_out);
  return std::make_tuple(q_out, k_out);
}
