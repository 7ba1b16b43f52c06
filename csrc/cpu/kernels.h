// CPU kernels (C++17 + OpenMP, no ATen): GAE and the fused log-prob/entropy statistics.
// Shapes are row-major; every pointer is to the first element; the caller validates shapes and dtypes.
#pragma once
#include <stdint.h>

#include "../dtype.h"

namespace mppo_cpu {

// GAE over [B, T] (verl's reverse recursion, masked steps skipped, outputs zero at masked positions).
// rewards/values: F32, F64 or BF16; mask: BOOL; out (advantages, returns): F32, F64 or BF16.
// Accumulates in double: the recursion is latency-bound on one row per thread, so double costs nothing here.
void gae(const void* rewards, mppo_dtype rewards_dtype, const void* values, mppo_dtype values_dtype,
         const uint8_t* mask, void* advantages, void* returns, mppo_dtype out_dtype, int64_t batch,
         int64_t length, double gamma, double lam);

// Per-row partial statistics of logits [N, V_local] (row stride in elements, last dim contiguous), local to this
// vocabulary shard, written as out[4, N] (F64 for F64 logits, else F32):
//   out[0] = max_j x_j                      (local max M; -inf when the shard row is all -inf)
//   out[1] = sum_j exp(x_j - M)             (sum-exp relative to M)
//   out[2] = sum_j exp(x_j - M) (x_j - M)   (p-weighted shifted logit, unnormalised)
//   out[3] = x[target - vocab_start] if this shard holds the target, else 0
// ops/ rebases them onto the global max, sums across TP ranks and finishes log-prob and entropy.
void lse_partials(const void* logits, mppo_dtype logits_dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
                  const int64_t* target, int64_t vocab_start, void* out);

// grad wrt logits of  sum_n g_lp[n] * logp[n] + g_ent[n] * H[n]  given the finished per-row log-normaliser
// log_z = log sum_j exp(x_j) (global over TP) and entropy H:
//   grad_j = -p_j (g_lp + g_ent (x_j - log_z + H)) + g_lp [j == target],   p_j = exp(x_j - log_z)
// row_stats are 4 arrays of length N in the statistics dtype (F64 for F64 logits, else F32): log_z, H, g_lp, g_ent.
// grad has the logits dtype and is contiguous [N, V_local].
void lse_backward(const void* logits, mppo_dtype logits_dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
                  const int64_t* target, int64_t vocab_start, const void* log_z, const void* entropy,
                  const void* grad_logp, const void* grad_entropy, void* grad_logits);

}  // namespace mppo_cpu
