// Torch binding of the hf-paged CUDA kernels; built on first use by
// hf_paged/kernels/cuda_ops.py (torch.utils.cpp_extension) on a machine with a CUDA toolkit.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "paged_ops.h"

namespace {

hf_paged::DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return hf_paged::DType::kFloat32;
    case torch::kFloat16: return hf_paged::DType::kFloat16;
    case torch::kBFloat16: return hf_paged::DType::kBFloat16;
    default: TORCH_CHECK(false, "hf-paged CUDA kernels take float32, float16 or bfloat16; got ", t.scalar_type());
  }
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "hf-paged ", what, " failed: ", cudaGetErrorString(err));
}

// query [R, Hq, D]; caches [NB, BS, Hkv, D]; block_tables [R, nb] int32; seq_lens [R] int64.
torch::Tensor decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor seq_lens,
                     c10::optional<torch::Tensor> alibi_slopes, double scale, int64_t window,
                     int64_t max_seq_len, int64_t partition, double softcap,
                     c10::optional<torch::Tensor> sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  query = query.contiguous();
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "block_tables must be int32 with unit column stride");
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(query);
  hf_paged::DecodeArgs a{};
  a.rows = query.size(0);
  a.num_heads = query.size(1);
  a.head_dim = query.size(2);
  switch (k_cache.scalar_type()) {  // 8-bit views: values and a bfloat16 scale per head
    case c10::kChar: a.kv_quant = 1; break;
    case c10::kFloat8_e4m3fn: a.kv_quant = 2; break;
    case c10::kFloat8_e5m2: a.kv_quant = 3; break;
    default: TORCH_CHECK(k_cache.scalar_type() == query.scalar_type(),
                         "the caches must hold the query's dtype or 8-bit values");
  }
  a.block_size = k_cache.size(1);
  a.num_kv_heads = k_cache.size(2);
  a.bt_stride = block_tables.stride(0);
  a.partition = partition;
  a.num_partitions = std::max<int64_t>(1, (max_seq_len + partition - 1) / partition);
  a.scale = static_cast<float>(scale);
  a.window = static_cast<int>(window);
  a.softcap = static_cast<float>(softcap);
  torch::Tensor part_out, part_max, part_sum, slopes, sink_logits;
  if (a.num_partitions > 1) {
    auto f = query.options().dtype(torch::kFloat32);
    part_out = torch::empty({a.rows, a.num_heads, a.num_partitions, a.head_dim}, f);
    part_max = torch::empty({a.rows, a.num_heads, a.num_partitions}, f);
    part_sum = torch::empty({a.rows, a.num_heads, a.num_partitions}, f);
    a.part_out = part_out.data_ptr<float>();
    a.part_max = part_max.data_ptr<float>();
    a.part_sum = part_sum.data_ptr<float>();
  }
  if (alibi_slopes.has_value()) {
    slopes = alibi_slopes->to(torch::kFloat32).contiguous();
    a.alibi_slopes = slopes.data_ptr<float>();
  }
  if (sinks.has_value()) {
    sink_logits = sinks->to(torch::kFloat32).contiguous();
    a.sinks = sink_logits.data_ptr<float>();
  }
  a.query = query.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.out = out.data_ptr();
  check(hf_paged::paged_decode(a, dtype_of(query), c10::cuda::getCurrentCUDAStream()), "paged_decode");
  return out;
}

void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
              torch::Tensor v_cache, torch::Tensor slots) {
  const c10::cuda::CUDAGuard guard(key.device());
  key = key.contiguous();
  value = value.contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  const int row = key.size(1) * key.size(2);
  check(hf_paged::write_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           slots.data_ptr<int64_t>(), key.size(0), row, row, dtype_of(key),
                           c10::cuda::getCurrentCUDAStream()), "write_kv");
}

// kv [L, 2, NB, BS, Hkv, D]
void copy_blocks(torch::Tensor kv, torch::Tensor src, torch::Tensor dst) {
  const c10::cuda::CUDAGuard guard(kv.device());
  src = src.to(torch::kInt64).contiguous();
  dst = dst.to(torch::kInt64).contiguous();
  const int64_t planes = kv.size(0) * kv.size(1);
  const int64_t block_elems = kv.stride(2);
  check(hf_paged::copy_blocks(kv.data_ptr(), src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(),
                              src.numel(), planes, kv.stride(1), block_elems, dtype_of(kv),
                              c10::cuda::getCurrentCUDAStream()), "copy_blocks");
}

// src_cache / dst_cache [NB, ...] (one on the GPU, one in host memory); pairs [n, 2] on the CPU.
void swap_blocks(torch::Tensor src_cache, torch::Tensor dst_cache, torch::Tensor pairs) {
  TORCH_CHECK(pairs.device().is_cpu(), "swap_blocks: pairs must be on the CPU");
  TORCH_CHECK(src_cache.is_cuda() != dst_cache.is_cuda(), "swap_blocks moves between GPU and CPU");
  const auto& gpu = src_cache.is_cuda() ? src_cache : dst_cache;
  const c10::cuda::CUDAGuard guard(gpu.device());
  pairs = pairs.to(torch::kInt64).contiguous();
  auto src = pairs.select(1, 0).contiguous();
  auto dst = pairs.select(1, 1).contiguous();
  const int64_t block_bytes = src_cache.stride(0) * src_cache.element_size();
  const auto kind = src_cache.is_cuda() ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  check(hf_paged::swap_blocks(src_cache.data_ptr(), dst_cache.data_ptr(), src.data_ptr<int64_t>(),
                              dst.data_ptr<int64_t>(), src.numel(), block_bytes, kind,
                              c10::cuda::getCurrentCUDAStream()), "swap_blocks");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "paged decode attention");
  m.def("write_kv", &write_kv, "KV write by slot mapping");
  m.def("copy_blocks", &copy_blocks, "copy-on-write block copies");
  m.def("swap_blocks", &swap_blocks, "block swap between GPU and CPU");
}
