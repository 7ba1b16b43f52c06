// Element types understood by the ATen-free kernels (CPU and CUDA). The torch bindings map torch dtypes onto these
// codes; the kernels never see a torch type, so they compile with a plain C++ compiler or plain nvcc.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define MPPO_HD __host__ __device__ __forceinline__
#else
#define MPPO_HD inline
#endif

enum mppo_dtype : int32_t {
  MPPO_F32 = 0,
  MPPO_F64 = 1,
  MPPO_BF16 = 2,  // raw uint16 bits of a bfloat16
  MPPO_BOOL = 3,  // one byte, 0 or 1 (torch.bool / uint8 masks)
};

// bfloat16 <-> float without any library type: bf16 is the top half of an IEEE float32.
MPPO_HD float mppo_bf16_to_float(uint16_t bits) {
  union { uint32_t u; float f; } v;
  v.u = static_cast<uint32_t>(bits) << 16;
  return v.f;
}

// Round to nearest, ties to even (what torch does); NaN stays a quiet NaN.
MPPO_HD uint16_t mppo_float_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((v.u >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
  return static_cast<uint16_t>((v.u + rounding) >> 16);
}
