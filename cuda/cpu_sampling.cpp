// Greedy tokens on CPU (the sampler's argmax, for rows that only take their maximum).
//
// torch.max(-1) with indices runs a scalar loop per element; at a step's few hundred rows
// of a 32k vocabulary it took longer than the decode's attention. This reads each row
// once at vector speed.
//
//   logits [R, V] float32, rows contiguous
//   -> tokens [R] int64: the first index of each row's maximum (of its first NaN, if any)
//      valid  [R] bool:  the maximum is finite and the row has no NaN (as torch.max's
//                        maximum being finite: NaN propagates to it)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <tuple>

namespace {

typedef float float8 __attribute__((vector_size(32)));
typedef int32_t int8x __attribute__((vector_size(32)));

// One row in one pass, eight lanes: each lane keeps its maximum and where it first saw it
// (a strictly greater value moves it), then the lanes agree on the maximum and its first
// index. NaN never compares greater; it is noted apart.
inline void row_argmax(const float* row, int64_t vocab, int64_t* token, bool* ok) {
  float best = -INFINITY;
  int64_t at = 0, i = 0;
  bool nan = false;
  if (vocab >= 8) {
    float8 m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const int8x lane = {0, 1, 2, 3, 4, 5, 6, 7};
    int8x where = lane, nans = {};
    for (; i + 8 <= vocab; i += 8) {
      float8 v;
      std::memcpy(&v, row + i, sizeof(v));
      const int8x greater = v > m;
      m = greater ? v : m;
      where = greater ? lane + static_cast<int32_t>(i) : where;
      nans |= v != v;
    }
    for (int l = 0; l < 8; ++l) {
      nan |= nans[l] != 0;
      if (m[l] > best || (m[l] == best && where[l] < at)) best = m[l], at = where[l];
    }
  }
  for (; i < vocab; ++i) {
    nan |= row[i] != row[i];
    if (row[i] > best) best = row[i], at = i;
  }
  if (nan) {  // torch.max's index: the first NaN's
    at = 0;
    while (row[at] == row[at]) ++at;
  }
  *token = at;
  *ok = !nan && std::isfinite(best);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> cpu_greedy(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                  logits.stride(1) == 1,
              "greedy: logits [R, V] float32 with contiguous rows expected");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "greedy: a vocabulary under 2^31 expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto tokens = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  auto valid = torch::empty({rows}, logits.options().dtype(torch::kBool));
  const float* x = logits.data_ptr<float>();
  int64_t* token = tokens.data_ptr<int64_t>();
  bool* ok = valid.data_ptr<bool>();
  // Enough rows per task that a task outlasts its scheduling.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_argmax(x + r * stride, vocab, token + r, ok + r);
  });
  return {tokens, valid};
}
