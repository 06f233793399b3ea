// hf-paged cache operations: KV write by slot mapping, copy-on-write block copies, and
// block swaps between GPU and CPU memory. Layouts as in hf_paged/kernels/reference.py.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "paged_ops.h"

namespace hf_paged {

// Grid (N): token n's row of row_elems elements goes to slot slots[n].
template <typename T>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                T* __restrict__ k_cache, T* __restrict__ v_cache,
                                const int64_t* __restrict__ slots, int row_elems,
                                int64_t key_stride) {
  const int64_t n = blockIdx.x;
  const int64_t slot = slots[n];
  if (slot < 0) return;
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
    k_cache[slot * row_elems + i] = key[n * key_stride + i];
    v_cache[slot * row_elems + i] = value[n * key_stride + i];
  }
}

// Grid (pairs, planes): one block of one plane.
template <typename T>
__global__ void copy_blocks_kernel(T* __restrict__ kv, const int64_t* __restrict__ src,
                                   const int64_t* __restrict__ dst, int64_t plane_stride,
                                   int64_t block_elems) {
  T* plane = kv + blockIdx.y * plane_stride;
  const T* from = plane + src[blockIdx.x] * block_elems;
  T* to = plane + dst[blockIdx.x] * block_elems;
  for (int64_t i = threadIdx.x; i < block_elems; i += blockDim.x) to[i] = from[i];
}

template <typename T>
static cudaError_t write_typed(const void* key, const void* value, void* k_cache, void* v_cache,
                               const int64_t* slots, int64_t n, int row_elems,
                               int64_t key_stride, cudaStream_t stream) {
  write_kv_kernel<T><<<static_cast<unsigned>(n), 128, 0, stream>>>(
      static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(k_cache),
      static_cast<T*>(v_cache), slots, row_elems, key_stride);
  return cudaGetLastError();
}

cudaError_t write_kv(const void* key, const void* value, void* k_cache, void* v_cache,
                     const int64_t* slots, int64_t num_tokens, int row_elems, int64_t key_stride,
                     DType dtype, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return write_typed<float>(key, value, k_cache, v_cache, slots, num_tokens, row_elems, key_stride, stream);
    case DType::kFloat16:
      return write_typed<__half>(key, value, k_cache, v_cache, slots, num_tokens, row_elems, key_stride, stream);
    case DType::kBFloat16:
      return write_typed<__nv_bfloat16>(key, value, k_cache, v_cache, slots, num_tokens, row_elems, key_stride, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t copy_blocks(void* kv, const int64_t* src, const int64_t* dst, int64_t num_pairs,
                        int64_t planes, int64_t plane_stride, int64_t block_elems, DType dtype,
                        cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(planes));
  switch (dtype) {
    case DType::kFloat32:
      copy_blocks_kernel<float><<<grid, 256, 0, stream>>>(static_cast<float*>(kv), src, dst, plane_stride, block_elems);
      break;
    case DType::kFloat16:
      copy_blocks_kernel<__half><<<grid, 256, 0, stream>>>(static_cast<__half*>(kv), src, dst, plane_stride, block_elems);
      break;
    case DType::kBFloat16:
      copy_blocks_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(kv), src, dst, plane_stride, block_elems);
      break;
  }
  return cudaGetLastError();
}

cudaError_t swap_blocks(const void* src_base, void* dst_base, const int64_t* src,
                        const int64_t* dst, int64_t num_pairs, int64_t block_bytes,
                        cudaMemcpyKind kind, cudaStream_t stream) {
  const char* from = static_cast<const char*>(src_base);
  char* to = static_cast<char*>(dst_base);
  for (int64_t i = 0; i < num_pairs; ++i) {
    cudaError_t err = cudaMemcpyAsync(to + dst[i] * block_bytes, from + src[i] * block_bytes,
                                      block_bytes, kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace hf_paged
