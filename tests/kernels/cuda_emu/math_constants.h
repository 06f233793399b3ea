// CPU stand-in for math_constants.h (see cuda_runtime.h here).
#pragma once

#include <cmath>

#define CUDART_INF_F INFINITY
#define CUDART_NAN_F NAN
