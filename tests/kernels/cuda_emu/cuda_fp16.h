// CPU stand-in for cuda_fp16.h (see cuda_runtime.h here): IEEE half via GCC's _Float16.
#pragma once

struct __half {
  _Float16 v;
};
inline float __half2float(__half x) { return static_cast<float>(x.v); }
inline __half __float2half(float x) { return __half{static_cast<_Float16>(x)}; }
