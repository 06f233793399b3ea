// C entry points over cuda/'s host functions for tests/test_cuda_emulated.py (ctypes).
// Built with the CPU emulator headers of this folder in place of the CUDA toolkit's, so
// every pointer is host memory (torch CPU tensors).
#include "cuda_runtime.h"
#include "paged_ops.h"

using hf_paged::DType;

extern "C" {

const char* emu_last_message() { return hf_emu::state().message.c_str(); }

int emu_decode(const void* query, const void* k_cache, const void* v_cache,
               const int32_t* block_tables, const int64_t* seq_lens, const float* alibi_slopes,
               void* out, float* part_out, float* part_max, float* part_sum, int rows,
               int num_heads, int num_kv_heads, int head_dim, int block_size, int bt_stride,
               int partition, int num_partitions, float scale, int window, int dtype,
               float softcap, const float* sinks, int kv_quant) {
  hf_paged::DecodeArgs a{};
  a.query = query;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.block_tables = block_tables;
  a.seq_lens = seq_lens;
  a.alibi_slopes = alibi_slopes;
  a.out = out;
  a.part_out = part_out;
  a.part_max = part_max;
  a.part_sum = part_sum;
  a.rows = rows;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.block_size = block_size;
  a.bt_stride = bt_stride;
  a.partition = partition;
  a.kv_quant = kv_quant;
  a.num_partitions = num_partitions;
  a.scale = scale;
  a.window = window;
  a.softcap = softcap;
  a.sinks = sinks;
  return hf_paged::paged_decode(a, static_cast<DType>(dtype), nullptr);
}

int emu_write_kv(const void* key, const void* value, void* k_cache, void* v_cache,
                 const int64_t* slots, int64_t num_tokens, int row_elems, int64_t key_stride,
                 int dtype) {
  return hf_paged::write_kv(key, value, k_cache, v_cache, slots, num_tokens, row_elems,
                            key_stride, static_cast<DType>(dtype), nullptr);
}

int emu_copy_blocks(void* kv, const int64_t* src, const int64_t* dst, int64_t num_pairs,
                    int64_t planes, int64_t plane_stride, int64_t block_elems, int dtype) {
  return hf_paged::copy_blocks(kv, src, dst, num_pairs, planes, plane_stride, block_elems,
                               static_cast<DType>(dtype), nullptr);
}

int emu_swap_blocks(const void* src_base, void* dst_base, const int64_t* src, const int64_t* dst,
                    int64_t num_pairs, int64_t block_bytes, int to_host) {
  return hf_paged::swap_blocks(src_base, dst_base, src, dst, num_pairs, block_bytes,
                               to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, nullptr);
}

}  // extern "C"
