// The CPU extension's Python module: the decode attention (cpu_paged_attention.cpp), the
// pool write (cpu_cache_ops.cpp), the greedy argmax (cpu_sampling.cpp) and the rotary
// embedding (cpu_rotary.cpp), built together by hf_paged/kernels/cpu_ops.py.

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor cpu_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                         int64_t window, double softcap,
                         c10::optional<torch::Tensor> alibi_slopes,
                         c10::optional<torch::Tensor> sinks);
void cpu_write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key,
                  torch::Tensor value, torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> cpu_greedy(torch::Tensor logits);
std::optional<std::tuple<torch::Tensor, torch::Tensor>> cpu_rotary(
    torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &cpu_decode, "Decode attention read from the paged pool (CPU)");
  m.def("write_kv", &cpu_write_kv, "New keys and values into the paged pool (CPU)");
  m.def("greedy", &cpu_greedy, "Each row's first maximum and whether it is finite (CPU)");
  m.def("rotary", &cpu_rotary, "Rotary embedding of queries and keys in one pass (CPU)");
}
