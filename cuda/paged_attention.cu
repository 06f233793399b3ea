// Paged decode attention for hf-paged: one new token per sequence over its cached blocks.
//
// Layout (same as hf_paged/kernels/reference.py):
//   query        [R, Hq, D]            one token per row
//   k_cache      [NB, BS, Hkv, D]      one layer's pool, v_cache likewise
//   block_tables [R, max_blocks] int32 (row stride given)
//   seq_lens     [R] int64             tokens cached per row, the query's own included
//   out          [R, Hq, D]
//   sinks        [Hq] float32 or null: a per-head logit joining each softmax's denominator
//   softcap      scores -> softcap * tanh(scores / softcap) before the softmax (0: none)
//   kv_quant     0: caches hold the query's type; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2: caches
//                are bytes [NB, BS, Hkv, D + 2], each head's D values then the bit pattern
//                of its bfloat16 scale (hf_paged/kv/quant.py); a value reads as v * scale
//
// A thread block handles (row, KV head, partition of PARTITION tokens) and all GROUP query
// heads of that KV head, so each K/V row is loaded once for the group. With one partition
// per row the output is written directly ("single pass"); otherwise each partition writes
// an unnormalized partial plus its max and sum, and paged_decode_reduce merges them
// (split-KV with a log-sum-exp merge).

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>
#include <string.h>

#include "paged_ops.h"

namespace hf_paged {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Falcon's ALiBi term before scaling, as Transformers computes it: the slope, the key
// position and their product rounded to bfloat16 (reference.alibi_bias).
__device__ __forceinline__ float alibi(float slope, int t) {
  const float s = __bfloat162float(__float2bfloat16(slope));
  const float position = __bfloat162float(__float2bfloat16(static_cast<float>(t)));
  return __bfloat162float(__float2bfloat16(s * position));
}

// 8-bit values, decoded bit by bit (no fp8 headers needed, any architecture).
template <int Q> __device__ __forceinline__ float dequant(uint8_t b);
template <> __device__ __forceinline__ float dequant<1>(uint8_t b) {
  return static_cast<float>(static_cast<int8_t>(b));
}
template <> __device__ __forceinline__ float dequant<2>(uint8_t b) {  // e4m3fn: no infinities
  const int e = (b >> 3) & 0xF, m = b & 7;
  float v = e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(static_cast<float>(8 + m), e - 10);
  if (e == 15 && m == 7) v = CUDART_NAN_F;
  return (b & 0x80) ? -v : v;
}
template <> __device__ __forceinline__ float dequant<3>(uint8_t b) {  // e5m2
  const int e = (b >> 2) & 0x1F, m = b & 3;
  float v = e == 0 ? ldexpf(static_cast<float>(m), -16) : ldexpf(static_cast<float>(4 + m), e - 17);
  if (e == 31) v = m == 0 ? CUDART_INF_F : CUDART_NAN_F;
  return (b & 0x80) ? -v : v;
}

// One cached head of one token, read as floats: T values, or (Q > 0) 8-bit values and
// their bfloat16 scale.
template <typename T, int Q>
struct CachedHead {
  const uint8_t* p;
  float scale;
  __device__ __forceinline__ CachedHead(const void* cache, int64_t slot, int heads, int kvh,
                                        int dim)
      : p(static_cast<const uint8_t*>(cache) + (slot * heads + kvh) * (dim + 2)) {
    const uint32_t bits = (static_cast<uint32_t>(p[dim]) | (static_cast<uint32_t>(p[dim + 1]) << 8)) << 16;
    memcpy(&scale, &bits, sizeof(float));
  }
  __device__ __forceinline__ float operator[](int d) const { return dequant<Q>(p[d]) * scale; }
};

template <typename T>
struct CachedHead<T, 0> {
  const T* p;
  __device__ __forceinline__ CachedHead(const void* cache, int64_t slot, int heads, int kvh,
                                        int dim)
      : p(static_cast<const T*>(cache) + (slot * heads + kvh) * dim) {}
  __device__ __forceinline__ float operator[](int d) const { return to_float(p[d]); }
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
  return x;
}

// Block-wide reduction of one value per thread; `scratch` holds kWarps floats.
template <bool kMax>
__device__ float block_reduce(float x, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  x = kMax ? warp_max(x) : warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = kMax ? -CUDART_INF_F : 0.f;
  for (int w = 0; w < kWarps; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

// Dynamic shared memory: q [GROUP][D] floats, then logits [GROUP][PARTITION] floats.
template <typename T, int Q, int GROUP>
__global__ void paged_decode_kernel(
    const T* __restrict__ query, const void* __restrict__ k_cache, const void* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int64_t* __restrict__ seq_lens,
    const float* __restrict__ alibi_slopes, T* __restrict__ out, float* __restrict__ part_out,
    float* __restrict__ part_max, float* __restrict__ part_sum, const float* __restrict__ sinks,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int bt_stride,
    int partition, int num_partitions, float scale, int window, float softcap) {
  extern __shared__ float smem[];
  __shared__ float scratch[kWarps];
  const int row = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
  const int seq_len = static_cast<int>(seq_lens[row]);
  const int first_visible = window > 0 ? max(seq_len - window, 0) : 0;
  const int start = max(part * partition, first_visible);
  const int end = min((part + 1) * partition, seq_len);
  float* q_s = smem;
  float* logits = smem + GROUP * head_dim;

  for (int i = threadIdx.x; i < GROUP * head_dim; i += kThreads) {
    const int g = i / head_dim, d = i % head_dim;
    q_s[i] = to_float(query[(static_cast<int64_t>(row) * num_heads + kvh * GROUP + g) * head_dim + d]) * scale;
  }
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t* table = block_tables + static_cast<int64_t>(row) * bt_stride;
  // Scores: one warp per token, lanes across the head dimension.
  for (int t = start + warp; t < end; t += kWarps) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const CachedHead<T, Q> k(k_cache, slot, num_kv_heads, kvh, head_dim);
    float acc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc[g] = 0.f;
    for (int d = lane; d < head_dim; d += 32) {
      const float kd = k[d];
#pragma unroll
      for (int g = 0; g < GROUP; ++g) acc[g] += q_s[g * head_dim + d] * kd;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float s = warp_sum(acc[g]);
      if (softcap > 0.f) s = softcap * tanhf(s / softcap);
      if (alibi_slopes != nullptr) s += alibi(alibi_slopes[kvh * GROUP + g], t) * scale;
      if (lane == 0) logits[g * partition + (t - part * partition)] = s;
    }
  }
  __syncthreads();

  // Softmax over this partition, per query head of the group.
  const int n = end - start;
  const int offset = start - part * partition;
  float maxes[GROUP], sums[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float m = -CUDART_INF_F;
    for (int i = threadIdx.x; i < n; i += kThreads) m = fmaxf(m, logits[g * partition + offset + i]);
    m = block_reduce<true>(m, scratch);
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const float p = __expf(logits[g * partition + offset + i] - m);
      logits[g * partition + offset + i] = p;
      s += p;
    }
    sums[g] = block_reduce<false>(s, scratch);
    maxes[g] = m;
  }
  __syncthreads();

  // Output: threads across the head dimension, each holding the group's GROUP sums, so a
  // V value is read from the cache once for the whole group.
  for (int d = threadIdx.x; d < head_dim; d += kThreads) {
    float acc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc[g] = 0.f;
    for (int t = start; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
      const float vd = CachedHead<T, Q>(v_cache, slot, num_kv_heads, kvh, head_dim)[d];
      const float* p = logits + (t - part * partition);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) acc[g] += p[g * partition] * vd;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const int head = kvh * GROUP + g;
      const int64_t o = (static_cast<int64_t>(row) * num_heads + head) * head_dim + d;
      if (num_partitions == 1) {
        // A sink adds exp(sink - max) to the denominator (and nothing to the values).
        float denom = sums[g];
        if (sinks != nullptr) denom += n > 0 ? __expf(sinks[head] - maxes[g]) : 1.f;
        out[o] = from_float<T>(n > 0 ? acc[g] / denom : 0.f);
      } else {
        // part_out [R, Hq, P, D]; part_max, part_sum [R, Hq, P]
        const int64_t p = (static_cast<int64_t>(row) * num_heads + head) * num_partitions + part;
        part_out[p * head_dim + d] = acc[g];
        if (d == 0) {
          part_max[p] = n > 0 ? maxes[g] : -CUDART_INF_F;
          part_sum[p] = n > 0 ? sums[g] : 0.f;
        }
      }
    }
  }
}

// Merges partitions: grid (R, Hq), threads across D.
template <typename T>
__global__ void paged_decode_reduce_kernel(const float* __restrict__ part_out,
                                           const float* __restrict__ part_max,
                                           const float* __restrict__ part_sum,
                                           const float* __restrict__ sinks,
                                           T* __restrict__ out, int num_heads, int head_dim,
                                           int num_partitions) {
  const int row = blockIdx.x, head = blockIdx.y;
  const int64_t rh = static_cast<int64_t>(row) * num_heads + head;
  float m = sinks != nullptr ? sinks[head] : -CUDART_INF_F;
  for (int p = 0; p < num_partitions; ++p) m = fmaxf(m, part_max[rh * num_partitions + p]);
  float total = sinks != nullptr ? __expf(sinks[head] - m) : 0.f;
  for (int p = 0; p < num_partitions; ++p) {
    const float pm = part_max[rh * num_partitions + p];
    if (pm > -CUDART_INF_F) total += part_sum[rh * num_partitions + p] * __expf(pm - m);
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; ++p) {
      const float pm = part_max[rh * num_partitions + p];
      if (pm > -CUDART_INF_F)
        acc += part_out[(rh * num_partitions + p) * head_dim + d] * __expf(pm - m);
    }
    out[rh * head_dim + d] = from_float<T>(total > 0.f ? acc / total : 0.f);
  }
}

template <typename T, int Q, int GROUP>
static cudaError_t launch_group(const DecodeArgs& a, cudaStream_t stream) {
  const dim3 grid(a.rows, a.num_kv_heads, a.num_partitions);
  const size_t smem = sizeof(float) * GROUP * (a.head_dim + a.partition);
  // The 48 KiB default bounds static plus dynamic shared memory (the kernel's scratch too):
  // past it the launch fails with "invalid argument" unless the kernel opts in.
  if (smem + sizeof(float) * kWarps > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(paged_decode_kernel<T, Q, GROUP>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  paged_decode_kernel<T, Q, GROUP><<<grid, kThreads, smem, stream>>>(
      static_cast<const T*>(a.query), a.k_cache, a.v_cache, a.block_tables, a.seq_lens, a.alibi_slopes,
      static_cast<T*>(a.out), a.part_out, a.part_max, a.part_sum, a.sinks, a.num_heads,
      a.num_kv_heads, a.head_dim, a.block_size, a.bt_stride, a.partition, a.num_partitions,
      a.scale, a.window, a.softcap);
  if (a.num_partitions > 1) {
    paged_decode_reduce_kernel<T><<<dim3(a.rows, a.num_heads), 128, 0, stream>>>(
        a.part_out, a.part_max, a.part_sum, a.sinks, static_cast<T*>(a.out), a.num_heads,
        a.head_dim, a.num_partitions);
  }
  return cudaGetLastError();
}

template <typename T, int Q>
static cudaError_t launch_quant(const DecodeArgs& a, cudaStream_t stream) {
  switch (a.num_heads / a.num_kv_heads) {
    case 1: return launch_group<T, Q, 1>(a, stream);
    case 2: return launch_group<T, Q, 2>(a, stream);
    case 4: return launch_group<T, Q, 4>(a, stream);
    case 8: return launch_group<T, Q, 8>(a, stream);
    case 16: return launch_group<T, Q, 16>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
static cudaError_t launch_typed(const DecodeArgs& a, cudaStream_t stream) {
  switch (a.kv_quant) {
    case 0: return launch_quant<T, 0>(a, stream);
    case 1: return launch_quant<T, 1>(a, stream);
    case 2: return launch_quant<T, 2>(a, stream);
    case 3: return launch_quant<T, 3>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t paged_decode(const DecodeArgs& a, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(a, stream);
    case DType::kFloat16: return launch_typed<__half>(a, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace hf_paged
