// Device helpers shared by the CUDA kernels: typed loads/stores into the accumulation type, fast exp.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <cmath>

#include "../types.h"

// `#pragma unroll` for loops in __host__ __device__ functions: the device compiler's, and nothing for the host
// compiler (GCC warns about a pragma it does not know).
#ifdef __CUDA_ARCH__
#define MPPO_UNROLL _Pragma("unroll")
#else
#define MPPO_UNROLL
#endif

namespace mppo_cuda {

template <typename Acc>
__device__ __forceinline__ Acc load(const float* p, int64_t i) { return static_cast<Acc>(p[i]); }
template <typename Acc>
__device__ __forceinline__ Acc load(const double* p, int64_t i) { return static_cast<Acc>(p[i]); }
template <typename Acc>
__device__ __forceinline__ Acc load(const uint16_t* p, int64_t i) {
  return static_cast<Acc>(mppo_bf16_to_float(p[i]));
}

__device__ __forceinline__ void store(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store(float* p, int64_t i, double x) { p[i] = static_cast<float>(x); }
__device__ __forceinline__ void store(double* p, int64_t i, double x) { p[i] = x; }
__device__ __forceinline__ void store(double* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store(uint16_t* p, int64_t i, float x) { p[i] = mppo_float_to_bf16(x); }
__device__ __forceinline__ void store(uint16_t* p, int64_t i, double x) {
  p[i] = mppo_float_to_bf16(static_cast<float>(x));
}

// exp: on the device the SFU approximation for float (relative error ~2^-21 on the arguments used here, all <= 0)
// and the accurate libdevice exp for double; on the host (the test harness, tests/unit/test_ops_cuda_host.py) libm.
// Both give exp(-inf) = 0 and exp(NaN) = NaN, the only properties the kernels' -inf/NaN handling relies on.
MPPO_HD float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}
MPPO_HD double fast_exp(double x) {
#ifdef __CUDA_ARCH__
  return exp(x);
#else
  return std::exp(x);
#endif
}

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

inline unsigned int ceil_div(int64_t a, int64_t b) { return static_cast<unsigned int>((a + b - 1) / b); }

}  // namespace mppo_cuda
