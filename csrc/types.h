// Types shared by the ATen-free kernels (CPU and CUDA). The torch bindings map torch tensors onto these; the
// kernels never see a torch type, so they compile with a plain C++ compiler or plain nvcc.
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

// A 0/1 mask of any torch dtype (bool, uint8, int8/16/32/64, float16, bfloat16, float32, float64), read as raw bits
// so that one code path validates every dtype in the same pass that uses it:
//   nonzero (the position is valid): bits & magnitude != 0   (magnitude = all bits but a float's sign: -0.0 is 0)
//   a 0/1 value:                     nonzero bits == one, or zero   (NaN, 2, -1, 0.5 are not)
struct mppo_mask {
  const void* data;
  int32_t bytes;       // 1, 2, 4 or 8 (element size)
  uint64_t magnitude;  // bits that make the value nonzero
  uint64_t one;        // the bit pattern of 1 in this dtype
};

// Raw bits of element i, for a mask of ``Bits``-sized elements (uint8_t .. uint64_t).
template <typename Bits>
MPPO_HD uint64_t mppo_mask_bits(const mppo_mask& m, int64_t i) {
  return static_cast<const Bits*>(m.data)[i];
}
MPPO_HD bool mppo_mask_valid(const mppo_mask& m, uint64_t bits) { return (bits & m.magnitude) != 0; }
MPPO_HD bool mppo_mask_not01(const mppo_mask& m, uint64_t bits) {
  return (bits & m.magnitude) != 0 && bits != m.one;
}

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

// A [n_rows, vocab] block of logits (this rank's vocabulary shard, padding columns already cut off), last dim
// contiguous, and what the log-prob/entropy kernels need to know about it.
struct mppo_logits {
  const void* data;
  mppo_dtype dtype;        // MPPO_F32, MPPO_F64 or MPPO_BF16
  int64_t n_rows;
  int64_t vocab;           // columns that take part (> 0)
  int64_t row_stride;      // elements between rows (>= vocab)
  const int64_t* target;   // [n_rows] global vocabulary ids
  int64_t vocab_start;     // global id of column 0; targets outside [vocab_start, vocab_start + vocab) are not here
  double inv_temperature;  // the kernels see x * inv_temperature (sampling temperature folded in, no copy)
};
