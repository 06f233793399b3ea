// Plain-C++ interface of the hf-paged CUDA kernels (no torch headers), so that the kernels
// compile with nvcc alone and the torch binding (paged_ops_binding.cpp) stays thin.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace hf_paged {

enum class DType { kFloat32, kFloat16, kBFloat16 };

struct DecodeArgs {
  const void* query;           // [R, Hq, D]
  const void* k_cache;         // [NB, BS, Hkv, D]
  const void* v_cache;         // [NB, BS, Hkv, D]
  const int32_t* block_tables; // [R, bt_stride]
  const int64_t* seq_lens;     // [R]
  const float* alibi_slopes;   // [Hq] or nullptr
  void* out;                   // [R, Hq, D]
  float* part_out;             // [R, Hq, P, D] when num_partitions > 1
  float* part_max;             // [R, Hq, P]
  float* part_sum;             // [R, Hq, P]
  int rows, num_heads, num_kv_heads, head_dim, block_size, bt_stride;
  int partition;               // tokens per partition
  int num_partitions;          // ceil(max seq len / partition)
  float scale;
  int window;                  // sliding window, 0 = none
  float softcap;               // scores -> softcap * tanh(scores / softcap); 0 = none
  const float* sinks;          // [Hq] sink logits, or nullptr
  int kv_quant;                // 0: caches of the query's type; 1 int8, 2 fp8 e4m3, 3 fp8
                               // e5m2: bytes [NB, BS, Hkv, D + 2] (values, bfloat16 scale)
};

// Decode attention (single pass when num_partitions == 1, else split-KV + reduce).
cudaError_t paged_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream);

// key/value [N, Hkv * D] -> caches at flat slots (block * BS + offset); slot < 0 is skipped.
cudaError_t write_kv(const void* key, const void* value, void* k_cache, void* v_cache,
                     const int64_t* slots, int64_t num_tokens, int row_elems, int64_t key_stride,
                     DType dtype, cudaStream_t stream);

// Copy-on-write: for each pair i and each of `planes` (layer x K/V) planes of `kv`
// (planes of num_blocks blocks of block_elems elements), block src[i] -> dst[i].
cudaError_t copy_blocks(void* kv, const int64_t* src, const int64_t* dst, int64_t num_pairs,
                        int64_t planes, int64_t plane_stride, int64_t block_elems, DType dtype,
                        cudaStream_t stream);

// Block swap between device and host memory: block src[i] of `src_base` -> dst[i] of
// `dst_base` (block_bytes each), pairs given on the host. kind: cudaMemcpyDeviceToHost or
// cudaMemcpyHostToDevice (pinned host memory makes it asynchronous).
cudaError_t swap_blocks(const void* src_base, void* dst_base, const int64_t* src,
                        const int64_t* dst, int64_t num_pairs, int64_t block_bytes,
                        cudaMemcpyKind kind, cudaStream_t stream);

}  // namespace hf_paged
