// Decode attention on CPU, read straight from the paged pool (the "cpu" backend).
//
// The PyTorch reference gathers every row's blocks into a contiguous copy before its
// attention; at a few hundred tokens per row that copy costs twice the attention itself.
// This kernel reads each key and value once, where it lies, for one new token per row:
//
//   query        [R, Hq, D]        float32, float16 or bfloat16 (contiguous)
//   k/v_cache    [NB, bs, Hkv, D]  the layer's pool views, same dtype (strided over layers),
//                or 8-bit [NB, bs, Hkv, D + 2] (int8, float8_e4m3fn, float8_e5m2): D values
//                and the bit pattern of their bfloat16 scale (kv/quant.py), read as
//                value * scale
//   block_tables [R, nb] int32     physical block of each logical block
//   seq_lens     [R] int64         tokens cached, the new one included
//   -> out       [R, Hq, D]        query's dtype
//
// Row r's query sits at position seq_lens[r] - 1 and sees keys t with t < seq_lens[r] and,
// with a sliding window W, t > seq_lens[r] - 1 - W. Scores are q.k * scale, then
// softcap * tanh(score / softcap) (softcap > 0), plus bf16(slope[h] * bf16(t)) * scale (ALiBi
// as Transformers' Falcon computes it, key slot t),
// and a per-head sink logit joins each softmax's denominator (gpt-oss). Work is split over
// rows (and runs of KV heads when rows are few); the query heads of a GQA group share each
// key and value they read.
// Everything accumulates in float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Eight-lane vectors (GCC/Clang vector extensions: AVX, AVX-512 or NEON as compiled for),
// two accumulators so that consecutive multiply-adds do not wait on each other.
typedef float float8 __attribute__((vector_size(32)));

inline float8 load8(const float* p) {
  float8 v;
  std::memcpy(&v, p, sizeof(v));  // (unaligned)
  return v;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float8 s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += load8(a + i) * load8(b + i);
    s1 += load8(a + i + 8) * load8(b + i + 8);
  }
  for (; i + 8 <= n; i += 8) s0 += load8(a + i) * load8(b + i);
  s0 += s1;
  float acc = ((s0[0] + s0[1]) + (s0[2] + s0[3])) + ((s0[4] + s0[5]) + (s0[6] + s0[7]));
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Lane u of the result: the sum of the eight lanes of v[u].
inline float8 sum8(const float8* v) {
  typedef int32_t int8x __attribute__((vector_size(32)));
#if defined(__clang__)
#define HF_PAGED_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define HF_PAGED_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, int8x{__VA_ARGS__})
#endif
  // Pairs of lanes, then quarters, then halves: three rounds of adds over shuffles.
  float8 pairs[4], quads[2];
  for (int k = 0; k < 4; ++k) {
    pairs[k] = HF_PAGED_SHUFFLE(v[2 * k], v[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               HF_PAGED_SHUFFLE(v[2 * k], v[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int k = 0; k < 2; ++k) {
    quads[k] = HF_PAGED_SHUFFLE(pairs[2 * k], pairs[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               HF_PAGED_SHUFFLE(pairs[2 * k], pairs[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return HF_PAGED_SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         HF_PAGED_SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
#undef HF_PAGED_SHUFFLE
}

// out[u] = q . keys[u] for eight keys: eight independent accumulators, one query load per
// eight products (one accumulator chained over the head size waits on each multiply-add;
// at head size 128 that latency was most of the kernel's time).
inline float8 dot8(const float* __restrict q, const float* const* keys, int64_t n) {
  float8 acc[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const float8 qv = load8(q + d);
    for (int u = 0; u < 8; ++u) acc[u] += qv * load8(keys[u] + d);
  }
  float8 sums = sum8(acc);
  for (int64_t i = d; i < n; ++i) {
    for (int u = 0; u < 8; ++u) sums[u] += q[i] * keys[u][i];
  }
  return sums;
}

// a += sum over u of p[u] * x[u], four rows at once: one load and store of `a` per four.
inline void axpy4(float* __restrict a, const float* p, const float* const* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    float8 v = load8(a + i) + p[0] * load8(x[0] + i) + p[1] * load8(x[1] + i) +
               p[2] * load8(x[2] + i) + p[3] * load8(x[3] + i);
    std::memcpy(a + i, &v, sizeof(v));
  }
  for (; i < n; ++i) a[i] += p[0] * x[0][i] + p[1] * x[1][i] + p[2] * x[2][i] + p[3] * x[3][i];
}

// a += sum over u of p[u] * x[u], eight rows at once (two chains of four products).
inline void axpy8(float* __restrict a, const float* p, const float* const* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float8 lo = p[0] * load8(x[0] + i) + p[1] * load8(x[1] + i) +
                      p[2] * load8(x[2] + i) + p[3] * load8(x[3] + i);
    const float8 hi = p[4] * load8(x[4] + i) + p[5] * load8(x[5] + i) +
                      p[6] * load8(x[6] + i) + p[7] * load8(x[7] + i);
    const float8 v = load8(a + i) + (lo + hi);
    std::memcpy(a + i, &v, sizeof(v));
  }
  for (; i < n; ++i) {
    float lo = 0.f, hi = 0.f;
    for (int u = 0; u < 4; ++u) lo += p[u] * x[u][i], hi += p[u + 4] * x[u + 4][i];
    a[i] += lo + hi;
  }
}

// a += p * x over n floats.
inline void axpy(float* __restrict a, float p, const float* __restrict x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    float8 v = load8(a + i) + p * load8(x + i);
    std::memcpy(a + i, &v, sizeof(v));
  }
  for (; i < n; ++i) a[i] += p * x[i];
}

// exp(x) for x <= 0 (a softmax's shifted scores), on eight lanes or one (the same steps,
// so a score's weight does not depend on its lane): x = n ln2 + r with |r| <= ln2 / 2, e^r
// from its degree-6 Taylor-like polynomial (minimax coefficients), times 2^n built in the
// exponent bits. Relative error about 2e-7; below -87 (2^n a denormal) it returns 0. libm's
// expf is one call per score: at head sizes of 16 to 64 it was most of the kernel's time.
template <typename V, typename I>
inline V exp_nonpositive(V x) {
  const V big = V{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  V n = x * 1.44269504f + big;
  n = n - big;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  I bits;
  if constexpr (std::is_same<V, float>::value) {
    bits = (static_cast<I>(n) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  }
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? V{} : p * scale;  // (lane by lane on vectors)
}

// s[i] = exp(s[i] - m) for i < n; returns their sum (lanes summed in a fixed order).
inline float exp_shifted(float* s, int64_t n, float m) {
  typedef int32_t int8x __attribute__((vector_size(32)));
  float8 total = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float8 e = exp_nonpositive<float8, int8x>(load8(s + i) - m);
    std::memcpy(s + i, &e, sizeof(e));
    total += e;
  }
  float sum = ((total[0] + total[1]) + (total[2] + total[3])) +
              ((total[4] + total[5]) + (total[6] + total[7]));
  for (; i < n; ++i) {
    s[i] = exp_nonpositive<float, int32_t>(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// Falcon's ALiBi term before scaling, as Transformers computes it: the slope, the key
// position and their product rounded to bfloat16 (reference.alibi_bias).
inline float alibi(float slope, int64_t t) {
  const float s = static_cast<float>(c10::BFloat16(slope));
  const float position = static_cast<float>(c10::BFloat16(static_cast<float>(t)));
  return static_cast<float>(c10::BFloat16(s * position));
}

template <typename C>
constexpr bool is_8bit() {
  return std::is_same<C, int8_t>::value || std::is_same<C, c10::Float8_e4m3fn>::value ||
         std::is_same<C, c10::Float8_e5m2>::value;
}

// One cached head as float32: the values themselves (float32), converted, or dequantized
// with the scale stored after them (8-bit kinds).
template <typename C>
inline const float* as_float(const C* x, float* buffer, int64_t n) {
  if constexpr (std::is_same<C, float>::value) {
    return x;
  } else if constexpr (is_8bit<C>()) {
    c10::BFloat16 scale;
    std::memcpy(&scale, x + n, sizeof(scale));
    const float s = static_cast<float>(scale);
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(x[i]) * s;
    return buffer;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(x[i]);
    return buffer;
  }
}

// T: the query's (and output's) dtype; C: the cache's (T itself, or an 8-bit kind).
template <typename T, typename C>
void decode_rows(const torch::Tensor& query, const torch::Tensor& k_cache,
                 const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                 const torch::Tensor& seq_lens, torch::Tensor& out, double scale, int64_t window,
                 double softcap, const float* slopes, const float* sinks) {
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const T* q_ptr = query.data_ptr<T>();
  const C* k_ptr = static_cast<const C*>(k_cache.data_ptr());
  const C* v_ptr = static_cast<const C*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t table_stride = block_tables.stride(0);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool plain = cap <= 0.f && slopes == nullptr;  // a score is the scaled dot product

  // A job is a row and a run of `span` KV heads: per token it reads those heads' keys (and
  // later values) as one contiguous run, which is how the pool lays them out. Rows are
  // split into head runs only when there are too few rows to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  const int64_t runs = std::min<int64_t>(kv_heads, (2 * threads + rows - 1) / rows);
  const int64_t span = (kv_heads + runs - 1) / runs;
  const int64_t jobs_per_row = (kv_heads + span - 1) / span;
  at::parallel_for(0, rows * jobs_per_row, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = span * group;  // query heads of a job
    std::vector<float> q(most * dim), acc(most * dim), kbuf(8 * dim), scores, top(most),
        total(most);
    std::vector<float8> tops(most);  // per query head, the running maximum of its lanes
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / jobs_per_row, h0 = (job % jobs_per_row) * span;
      const int64_t h1 = std::min(kv_heads, h0 + span), n = lens[r];
      const int64_t qh0 = h0 * group, qheads = (h1 - h0) * group;  // its query heads
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t count = std::max<int64_t>(0, n - first);
      const int32_t* table = tables + r * table_stride;
      for (int64_t j = 0; j < qheads; ++j) {
        const T* src = q_ptr + (r * heads + qh0 + j) * dim;
        for (int64_t d = 0; d < dim; ++d) q[j * dim + d] = static_cast<float>(src[d]);
        top[j] = sinks != nullptr ? sinks[qh0 + j] : -INFINITY;
        tops[j] = float8{} - INFINITY;
      }
      scores.resize(qheads * count);
      // fn(i0, m, h): tokens i0 .. i0 + m (m <= tile) of KV head h of one view, as float32
      // rows heads8[0 .. m). Rows are found block by block: one division per tile.
      const C* tokens[8];
      const float* heads8[8];
      auto each_tile = [&](const C* base, int64_t sb, int64_t st, int64_t sh, int64_t tile,
                           auto&& fn) {
        for (int64_t i0 = 0; i0 < count; i0 += tile) {
          const int64_t m = std::min<int64_t>(tile, count - i0);
          int64_t t = first + i0, b = t / bs, off = t - b * bs;
          for (int64_t u = 0; u < m; ++u) {
            tokens[u] = base + table[b] * sb + off * st;
            if (++off == bs) off = 0, ++b;
          }
          for (int64_t h = h0; h < h1; ++h) {
            for (int64_t u = 0; u < m; ++u) {
              heads8[u] = as_float(tokens[u] + h * sh, kbuf.data() + u * dim, dim);
            }
            fn(i0, m, h);
          }
        }
      };
      // Query head j's score of token i (position t), from its dot product with the key.
      auto score = [&](int64_t j, int64_t i, int64_t t, float s) {
        s *= fscale;
        if (cap > 0.f) s = cap * std::tanh(s / cap);
        if (slopes != nullptr) s += alibi(slopes[qh0 + j], t) * fscale;
        scores[j * count + i] = s;
        top[j] = std::max(top[j], s);
      };
      each_tile(k_ptr, kb, kt, kh, 8, [&](int64_t i0, int64_t m, int64_t h) {  // keys
        for (int64_t j = (h - h0) * group; j < (h - h0 + 1) * group; ++j) {
          const float* qj = q.data() + j * dim;
          if (m == 8 && plain) {  // eight scores at once, their maximum kept per lane
            const float8 s = dot8(qj, heads8, dim) * fscale;
            std::memcpy(scores.data() + j * count + i0, &s, sizeof(s));
            tops[j] = s > tops[j] ? s : tops[j];
          } else if (m == 8) {
            const float8 s = dot8(qj, heads8, dim);
            for (int64_t u = 0; u < 8; ++u) score(j, i0 + u, first + i0 + u, s[u]);
          } else {
            for (int64_t u = 0; u < m; ++u) {
              score(j, i0 + u, first + i0 + u, dot(qj, heads8[u], dim));
            }
          }
        }
      });
      for (int64_t j = 0; j < qheads; ++j) {
        for (int u = 0; u < 8; ++u) top[j] = std::max(top[j], tops[j][u]);
        const float sink = sinks != nullptr ? std::exp(sinks[qh0 + j] - top[j]) : 0.f;
        total[j] = sink + exp_shifted(scores.data() + j * count, count, top[j]);
      }
      std::fill(acc.begin(), acc.begin() + qheads * dim, 0.f);
      each_tile(v_ptr, vb, vt, vh, 8, [&](int64_t i0, int64_t m, int64_t h) {  // values
        for (int64_t j = (h - h0) * group; j < (h - h0 + 1) * group; ++j) {
          const float* p = scores.data() + j * count + i0;
          if (m == 8) {
            axpy8(acc.data() + j * dim, p, heads8, dim);
          } else if (m >= 4) {
            axpy4(acc.data() + j * dim, p, heads8, dim);
            for (int64_t u = 4; u < m; ++u) axpy(acc.data() + j * dim, p[u], heads8[u], dim);
          } else {
            for (int64_t u = 0; u < m; ++u) axpy(acc.data() + j * dim, p[u], heads8[u], dim);
          }
        }
      });
      for (int64_t j = 0; j < qheads; ++j) {
        const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
        T* dst = o_ptr + (r * heads + qh0 + j) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[j * dim + d] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor cpu_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                         int64_t window, double softcap,
                         c10::optional<torch::Tensor> alibi_slopes,
                         c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "decode: query [R, Hq, D] and caches [NB, bs, Hkv, D] expected");
  TORCH_CHECK(query.is_contiguous(), "decode: the query must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "decode: each cached head must be contiguous");
  const auto kind = k_cache.scalar_type();
  const bool quantized = kind == torch::kChar || kind == at::kFloat8_e4m3fn ||
                         kind == at::kFloat8_e5m2;
  TORCH_CHECK(v_cache.scalar_type() == kind && (quantized || kind == query.scalar_type()),
              "decode: the caches must share a dtype, the query's or an 8-bit kind");
  TORCH_CHECK(query.size(2) + (quantized ? 2 : 0) == k_cache.size(3) &&
                  v_cache.size(3) == k_cache.size(3),
              "decode: keys, values and queries must share a head size");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0,
              "decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "decode: block tables must be int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "decode: seq_lens must be contiguous int64");
  torch::Tensor slopes, sink;
  if (alibi_slopes.has_value()) slopes = alibi_slopes->to(torch::kFloat32).contiguous();
  if (sinks.has_value()) sink = sinks->to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(query);
  const float* slope_ptr = slopes.defined() ? slopes.data_ptr<float>() : nullptr;
  const float* sink_ptr = sink.defined() ? sink.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode", [&] {
    using T = scalar_t;
    auto run = [&](auto cached) {
      using C = decltype(cached);
      decode_rows<T, C>(query, k_cache, v_cache, block_tables, seq_lens, out, scale, window,
                        softcap, slope_ptr, sink_ptr);
    };
    if (kind == torch::kChar) run(int8_t{});
    else if (kind == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
    else if (kind == at::kFloat8_e5m2) run(c10::Float8_e5m2{});
    else run(T{});
  });
  return out;
}
