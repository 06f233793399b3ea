// A CPU emulator of the CUDA runtime subset that cuda/*.cu uses, so the kernels' logic runs
// in CI without a GPU (tests/test_cuda_emulated.py builds cuda/ against these headers).
//
// Each thread block runs its threads as fibers on one OS thread. A fiber runs until it
// reaches __syncthreads() or a warp shuffle, then yields; a barrier opens once every live
// thread of its block (or lane of its warp) waits at it. Threads of a block that wait at
// different __syncthreads() calls (told apart by source line), and shuffles in a warp of
// fewer than 32 threads, are reported as errors rather than deadlocking. Blocks run one
// after another, so `__shared__` maps to `static` (static shared arrays keep the previous
// block's values); dynamic shared memory is filled with NaN bytes before each block, so
// reading a slot nobody wrote shows up in the results. Launches check CUDA's limits
// (threads per block, grid extents, dynamic shared memory above 48 KiB only after
// cudaFuncSetAttribute, at most 227 KiB).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

using std::max;
using std::min;

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
typedef void* cudaStream_t;

inline float __expf(float x) { return std::exp(x); }

namespace hf_emu {

constexpr size_t kDefaultDynamicSmem = 48 * 1024;
// The 48 KiB default bounds static plus dynamic shared memory. `__shared__` arrays are
// plain statics here, whose size the launch cannot see: it assumes they take this much.
constexpr size_t kStaticSmemReserve = 1024;
constexpr size_t kMaxDynamicSmem = 227 * 1024;  // sm_90 opt-in limit per block
constexpr size_t kStackBytes = 64 * 1024;

struct State {
  cudaError_t last_error = cudaSuccess;
  std::string message;                       // why the last launch failed
  std::map<const void*, size_t> smem_optin;  // kernel -> cudaFuncSetAttribute size
};
inline State& state() {
  static State s;
  return s;
}

inline void fail(cudaError_t err, const std::string& why) {
  if (state().last_error == cudaSuccess) {
    state().last_error = err;
    state().message = why;
  }
}

enum class Wait { kNone, kBlock, kWarp, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Wait wait = Wait::kNone;
  int site = 0;  // source line of the __syncthreads() it waits at
  dim3 thread;
};

struct Block {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  std::vector<char> smem;
  std::vector<float> shuffle[2];  // [parity][lane of the block]
  std::vector<int> shuffle_parity;
  int current = -1;
  unsigned threads = 0;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

struct Index {
  dim3 thread, block, block_dim, grid_dim;
};
inline Index& index() {
  static Index i;
  return i;
}

inline void yield(Wait why, int site = 0) {
  Block* b = block();
  Fiber& f = b->fibers[b->current];
  f.wait = why;
  f.site = site;
  swapcontext(&f.ctx, &b->scheduler);
  index().thread = f.thread;  // back on this fiber
}

inline void* dynamic_shared() { return block()->smem.data(); }

}  // namespace hf_emu

#define threadIdx (::hf_emu::index().thread)
#define blockIdx (::hf_emu::index().block)
#define blockDim (::hf_emu::index().block_dim)
#define gridDim (::hf_emu::index().grid_dim)

#define __syncthreads() ::hf_emu::yield(::hf_emu::Wait::kBlock, __LINE__)

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  hf_emu::Block* b = hf_emu::block();
  if (mask != 0xffffffffu) hf_emu::fail(cudaErrorLaunchFailure, "emulator: partial shuffle masks");
  const int me = b->current;
  if (me - me % 32 + 32 > static_cast<int>(b->threads)) {
    hf_emu::fail(cudaErrorLaunchFailure, "emulator: shuffle in a warp of fewer than 32 threads");
    return value;
  }
  int& parity = b->shuffle_parity[me];
  b->shuffle[parity][me] = static_cast<float>(value);
  hf_emu::yield(hf_emu::Wait::kWarp);  // every lane of the warp has written
  const int warp_base = me - me % 32;
  const T r = static_cast<T>(b->shuffle[parity][warp_base + ((me % 32) ^ lane_mask)]);
  parity ^= 1;  // the next shuffle writes the other buffer while slower lanes still read
  return r;
}

inline cudaError_t cudaGetLastError() {
  cudaError_t e = hf_emu::state().last_error;
  hf_emu::state().last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t) { return hf_emu::state().message.c_str(); }

template <typename F>
inline cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > hf_emu::kMaxDynamicSmem)
    return cudaErrorInvalidValue;
  hf_emu::state().smem_optin[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

namespace hf_emu {

template <typename Call>
struct Trampoline {
  static Call* call;
  static void run() {
    (*call)();
    Block* b = block();
    b->fibers[b->current].wait = Wait::kDone;
    swapcontext(&b->fibers[b->current].ctx, &b->scheduler);
  }
};
template <typename Call>
Call* Trampoline<Call>::call = nullptr;

// Runs one block to completion; returns false (after fail()) on divergent barriers.
template <typename Call>
bool run_block(Block& b, Call& call) {
  Trampoline<Call>::call = &call;
  for (unsigned t = 0; t < b.threads; ++t) {
    Fiber& f = b.fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    f.wait = Wait::kNone;
    makecontext(&f.ctx, &Trampoline<Call>::run, 0);
  }
  std::fill(b.shuffle_parity.begin(), b.shuffle_parity.end(), 0);
  for (;;) {
    for (unsigned t = 0; t < b.threads; ++t) {
      if (b.fibers[t].wait != Wait::kNone) continue;
      b.current = static_cast<int>(t);
      index().thread = b.fibers[t].thread;
      swapcontext(&b.scheduler, &b.fibers[t].ctx);
    }
    // Everyone is now waiting or done: open whichever barriers are complete.
    bool opened = false, all_done = true;
    for (unsigned w = 0; w * 32 < b.threads; ++w) {
      const unsigned lo = w * 32, hi = std::min(b.threads, lo + 32);
      int waiting = 0, live = 0;
      for (unsigned t = lo; t < hi; ++t) {
        if (b.fibers[t].wait != Wait::kDone) ++live;
        if (b.fibers[t].wait == Wait::kWarp) ++waiting;
      }
      if (waiting > 0 && waiting == live && live == static_cast<int>(hi - lo)) {
        for (unsigned t = lo; t < hi; ++t) b.fibers[t].wait = Wait::kNone;
        opened = true;
      }
    }
    int at_block = 0, live = 0, site = -1;
    bool one_site = true;
    for (unsigned t = 0; t < b.threads; ++t) {
      if (b.fibers[t].wait != Wait::kDone) ++live, all_done = false;
      if (b.fibers[t].wait == Wait::kBlock) {
        ++at_block;
        one_site = one_site && (site < 0 || site == b.fibers[t].site);
        site = b.fibers[t].site;
      }
    }
    if (all_done) return true;
    if (!opened && at_block == live && !one_site) {
      fail(cudaErrorLaunchFailure, "emulator: threads of a block wait at different __syncthreads()");
      return false;
    }
    if (!opened && at_block == live) {
      for (auto& f : b.fibers)
        if (f.wait == Wait::kBlock) f.wait = Wait::kNone;
      opened = true;
    }
    if (!opened) {
      fail(cudaErrorLaunchFailure,
           "emulator: threads of a block wait at different barriers (or a shuffle lacks lanes)");
      return false;
    }
  }
}

template <typename... P, typename... A>
void launch(dim3 grid, dim3 threads, size_t smem, cudaStream_t, void (*kernel)(P...),
            A&&... args) {
  const unsigned n = threads.x * threads.y * threads.z;
  if (n == 0 || n > 1024 || threads.z > 64 || grid.x == 0 || grid.x > 2147483647u ||
      grid.y == 0 || grid.y > 65535 || grid.z == 0 || grid.z > 65535) {
    fail(cudaErrorInvalidConfiguration, "emulator: invalid launch configuration");
    return;
  }
  const auto optin = state().smem_optin.find(reinterpret_cast<const void*>(kernel));
  const size_t limit = optin == state().smem_optin.end()
                           ? kDefaultDynamicSmem - kStaticSmemReserve : optin->second;
  if (smem > limit) {
    fail(cudaErrorInvalidValue, "emulator: dynamic shared memory " + std::to_string(smem) +
                                    " bytes exceeds the kernel's limit of " +
                                    std::to_string(limit));
    return;
  }
  std::tuple<P...> params(static_cast<P>(args)...);
  Block b;
  b.threads = n;
  b.fibers.resize(n);
  for (unsigned t = 0; t < n; ++t) {
    b.fibers[t].stack.resize(kStackBytes);
    b.fibers[t].thread = dim3(t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y));
  }
  b.shuffle[0].assign(n, 0.f);
  b.shuffle[1].assign(n, 0.f);
  b.shuffle_parity.assign(n, 0);
  block() = &b;
  index().block_dim = threads;
  index().grid_dim = grid;
  auto call = [&] { std::apply(kernel, params); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        index().block = dim3(x, y, z);
        b.smem.assign(smem, static_cast<char>(0xff));  // NaN floats: unwritten reads show
        if (!run_block(b, call)) {
          block() = nullptr;
          return;
        }
      }
  block() = nullptr;
}

}  // namespace hf_emu
