// CPU kernels (C++17 + OpenMP, no ATen): GAE and the fused log-prob/entropy statistics.
// Shapes are row-major; every pointer is to the first element; the caller validates shapes and dtypes.
#pragma once
#include <stdint.h>

#include "../types.h"

namespace mppo_cpu {

// GAE over [B, T] (verl's reverse recursion, masked steps skipped, outputs zero at masked positions).
// rewards/values: F32, F64 or BF16; mask: any dtype as mppo_mask (nonzero = valid); out (advantages, returns):
// F32, F64 or BF16. Accumulates in double: the loop is bound by memory traffic (~17 bytes a step), so double
// costs nothing here. The input checks are fused into the one pass the kernel makes anyway: counts[0], counts[1]
// receive the number of NaN/inf rewards and values at valid positions, counts[2] the number of mask entries that
// are not 0 or 1 (the outputs are meaningless when it is > 0: the caller raises).
void gae(const void* rewards, mppo_dtype rewards_dtype, const void* values, mppo_dtype values_dtype,
         const mppo_mask& mask, void* advantages, void* returns, mppo_dtype out_dtype, int64_t batch,
         int64_t length, double gamma, double lam, int64_t* counts);

// Per-row partial statistics of the logits block (x below is logits * inv_temperature), local to this vocabulary
// shard, written as out[4, N] (F64 for F64 logits, else F32):
//   out[0] = max_j x_j                      (local max M; -inf when the shard row is all -inf)
//   out[1] = sum_j exp(x_j - M)             (sum-exp relative to M)
//   out[2] = sum_j exp(x_j - M) (x_j - M)   (p-weighted shifted logit, unnormalised)
//   out[3] = x[target - vocab_start] if this shard holds the target, else 0
// ops/ rebases them onto the global max, sums across TP ranks and finishes log-prob and entropy.
void lse_partials(const mppo_logits& logits, void* out);

// grad wrt the logits of  sum_n g_lp[n] * logp[n] + g_ent[n] * H[n]  given the finished per-row log-normaliser
// log_z = log sum_j exp(x_j) (global over TP) and entropy H, with x = logits * inv_temperature (= t below):
//   grad_j = t * (-p_j (g_lp + g_ent (x_j - log_z + H)) + g_lp [j == target]),   p_j = exp(x_j - log_z)
// log_z, entropy, grad_logp, grad_entropy: [N] in the statistics dtype (F64 for F64 logits, else F32).
// grad: logits dtype, rows grad_row_stride apart (last dim contiguous); it may be the logits themselves (in-place).
void lse_backward(const mppo_logits& logits, const void* log_z, const void* entropy, const void* grad_logp,
                  const void* grad_entropy, void* grad, int64_t grad_row_stride);

}  // namespace mppo_cpu
