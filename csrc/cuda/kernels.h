// CUDA kernels for GAE and fused log-prob/entropy: a C launch API with no ATen/torch types, so the .cu files
// compile with plain `nvcc -c -arch=sm_90` (see tests/unit/test_ops_build.py). Semantics match csrc/cpu/kernels.h;
// the GPU accumulates in float32 (float64 for float64 inputs). Every launcher returns the launch status.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "../types.h"

#ifdef __cplusplus
extern "C" {
#endif

// GAE algorithm on the GPU.
//   MPPO_GAE_SERIAL: one thread per sequence walks T backwards (T dependent steps, B threads in flight).
//   MPPO_GAE_SCAN:   one thread block per sequence; the recursion is an affine map on (next_value, last_gae), so
//                    tiles of T are composed with a block-wide scan (coalesced loads, ~B*256 threads in flight).
//   MPPO_GAE_AUTO:   the default chosen by measurement (docs/kernels.md).
enum mppo_gae_algo : int32_t { MPPO_GAE_AUTO = 0, MPPO_GAE_SERIAL = 1, MPPO_GAE_SCAN = 2 };

// mask: any bool/integer/floating dtype as mppo_mask (nonzero = valid), same semantics as the CPU kernel.
// counts: device int64[3], zeroed by the caller; receives the NaN/inf counts of rewards and values at valid
// positions and the number of mask entries that are not 0/1 (the input checks, fused into the kernel's one pass;
// read it only when checks are wanted: host sync).
cudaError_t mppo_cuda_gae(const void* rewards, mppo_dtype rewards_dtype, const void* values, mppo_dtype values_dtype,
                          mppo_mask mask, void* advantages, void* returns, mppo_dtype out_dtype, int64_t batch,
                          int64_t length, double gamma, double lam, mppo_gae_algo algo, int64_t* counts,
                          cudaStream_t stream);

// Bytes of device workspace mppo_cuda_lse_partials needs for this shape (0 when one block per row suffices).
size_t mppo_cuda_lse_workspace_bytes(int64_t n_rows, int64_t vocab, mppo_dtype logits_dtype, int sm_count);

// out[4, N] (float32; float64 for float64 logits) of x = logits * inv_temperature: local max, sum exp(x - max),
// sum exp(x - max)(x - max), target logit (0 when the target is outside this shard); see csrc/cpu/kernels.h.
// Rows that would leave the GPU idle (few rows) are split over several blocks whose partial triples are merged by
// a second kernel (needs mppo_cuda_lse_workspace_bytes of workspace).
cudaError_t mppo_cuda_lse_partials(mppo_logits logits, void* out, void* workspace, size_t workspace_bytes,
                                   int sm_count, cudaStream_t stream);

// grad wrt the logits (logits dtype, rows grad_row_stride apart; may alias the logits) of
// sum_n g_lp[n] logp[n] + g_ent[n] H[n]; the four row arrays are in the statistics dtype.
cudaError_t mppo_cuda_lse_backward(mppo_logits logits, const void* log_z, const void* entropy,
                                   const void* grad_logp, const void* grad_entropy, void* grad,
                                   int64_t grad_row_stride, int sm_count, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
