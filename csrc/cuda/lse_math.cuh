// The per-element math of the log-prob/entropy kernels (logprob_entropy.cu) and the host-side launch arithmetic.
// The device parts are __host__ __device__ (MPPO_HD) so that the host harness of tests/unit/test_ops_cuda_host.py
// runs the very functions the kernels run (compiled with nvcc as host code, no GPU needed) and compares them with
// the CPU kernel and a float64 reference on edge rows (-inf first, all -inf, one-hot, NaN, 151936 columns, ...).
//
// A thread's state is an online triple (m, s, w) = (max, sum exp(x - m), sum exp(x - m)(x - m)) over the elements
// it has seen; triples of disjoint element sets merge into the triple of their union. -inf elements are exact zeros
// of the softmax and add nothing: a triple that has seen only -inf (or nothing) is (-inf, 0, 0), the CPU kernel's and
// the reference's statistics of an all -inf shard row. NaN anywhere reaches s (so the row's results are NaN).
#pragma once
#include <stdint.h>

#include <math_constants.h>

#include <cstring>
#include <limits>

#include "../types.h"
#include "common.cuh"

namespace mppo_cuda {

constexpr int kThreads = 256;                   // threads per block of the statistics and backward kernels
constexpr int64_t kMinElementsPerBlock = 16384;  // a row is split over blocks only down to this many columns each
constexpr int kBlocksPerSm = 4;                 // blocks per SM the split aims for

template <typename T> struct Vec16 { static constexpr int N = 16 / sizeof(T); };

template <typename T>
union Pack16 {
  uint4 raw;
  T e[Vec16<T>::N];
};

// 16 bytes through the read-only data cache on the device; a plain load on the host.
MPPO_HD uint4 load16(const uint4* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  uint4 v;
  std::memcpy(&v, p, sizeof(v));  // the host reads float/bf16 buffers: no aliasing through uint4
  return v;
#endif
}

template <typename Acc> MPPO_HD Acc elem(float x) { return static_cast<Acc>(x); }
template <typename Acc> MPPO_HD Acc elem(double x) { return static_cast<Acc>(x); }
template <typename Acc> MPPO_HD Acc elem(uint16_t x) { return static_cast<Acc>(mppo_bf16_to_float(x)); }

template <typename Acc>
struct Triple {
  Acc m, s, w;  // max, sum exp(x - m), sum exp(x - m) (x - m)
};

template <typename Acc> MPPO_HD Acc neg_inf();
template <> MPPO_HD float neg_inf<float>() {
#ifdef __CUDA_ARCH__
  return -CUDART_INF_F;
#else
  return -std::numeric_limits<float>::infinity();
#endif
}
template <> MPPO_HD double neg_inf<double>() {
#ifdef __CUDA_ARCH__
  return -CUDART_INF;
#else
  return -std::numeric_limits<double>::infinity();
#endif
}

template <typename Acc> MPPO_HD Acc lowest();  // the lowest finite value
template <> MPPO_HD float lowest<float>() { return -3.402823466e+38f; }
template <> MPPO_HD double lowest<double>() { return -1.7976931348623157e+308; }

// The state of a thread that has seen nothing (and of an all -inf part).
template <typename Acc> MPPO_HD Triple<Acc> empty_triple() { return {neg_inf<Acc>(), Acc(0), Acc(0)}; }

// Adds element x to t. A -inf element adds nothing: before the fix, x = t.m = -inf (a thread whose first element is
// -inf) gave x - t.m = NaN, and the NaN stayed in s for good (issue 23).
template <typename Acc>
MPPO_HD void online_add(Triple<Acc>& t, Acc x) {
  if (x > t.m) {  // rescale what was summed so far onto the new max (rare after the first elements)
    const Acc shift = t.m - x;  // < 0; -inf on the first finite element (s = w = 0 then, and stay 0)
    const Acc scale = fast_exp(shift);
    t.w = t.s > Acc(0) ? scale * (t.w + shift * t.s) : Acc(0);
    t.s *= scale;
    t.m = x;
  }
  // While t.m is still -inf, x is -inf (or NaN): x - t.m would be -inf - -inf = NaN, x - lowest is -inf (e = 0).
  // One max with a constant (a select between 0 and the exp compiled to a branch per element).
  const Acc d = x - (t.m > lowest<Acc>() ? t.m : lowest<Acc>());
  const Acc e = fast_exp(d);
  t.s += e;
  t.w += e > Acc(0) ? e * d : Acc(0);  // guards 0 * -inf; NaN (a NaN x, or x = t.m = +inf) still reaches t.s
}

// Adds part p into out, whose max is >= p's. Only a part with s > 0 has a finite max, so a -inf max is never
// subtracted: an empty or all -inf part adds its s = 0, a part that saw NaN adds its NaN s.
template <typename Acc>
MPPO_HD void merge_into(Triple<Acc>& out, const Triple<Acc>& p) {
  if (p.s > Acc(0)) {
    const Acc shift = p.m - out.m, scale = fast_exp(shift);
    out.s += scale * p.s;
    out.w += scale * (p.w + shift * p.s);
  } else {
    out.s += p.s;
  }
}

// The triple of the union of two disjoint element sets. (-inf, 0, 0) is its identity.
template <typename Acc>
MPPO_HD Triple<Acc> merge(const Triple<Acc>& x, const Triple<Acc>& y) {
  Triple<Acc> out{x.m > y.m ? x.m : y.m, Acc(0), Acc(0)};
  merge_into(out, x);
  merge_into(out, y);
  return out;
}

// Thread tid's share (of THREADS) of the columns [start, stop) of a row x, scaled by `scale`, added into t: 16-byte
// vector loads, element k * THREADS + tid, when x + start is 16-byte aligned; then the scalar tail, column
// j = scalar_from + tid + i * THREADS.
template <int THREADS, typename T, typename Acc>
MPPO_HD void accumulate_columns(Triple<Acc>& t, const T* x, int64_t start, int64_t stop, int tid, Acc scale) {
  constexpr int VEC = Vec16<T>::N;
  int64_t scalar_from = start;
  if ((reinterpret_cast<uintptr_t>(x + start) & 15) == 0) {
    const int64_t n_vec = (stop - start) / VEC;
    const uint4* xv = reinterpret_cast<const uint4*>(x + start);
    for (int64_t k = tid; k < n_vec; k += THREADS) {
      Pack16<T> p;
      p.raw = load16(xv + k);
      MPPO_UNROLL
      for (int e = 0; e < VEC; ++e) online_add(t, elem<Acc>(p.e[e]) * scale);
    }
    scalar_from = start + n_vec * VEC;
  }
  for (int64_t j = scalar_from + tid; j < stop; j += THREADS) online_add(t, elem<Acc>(x[j]) * scale);
}

// ---- host side: launch shape and argument checks ----

// Columns per block: enough blocks in total to fill the GPU (sm_count * kBlocksPerSm), never fewer than
// kMinElementsPerBlock per block, a multiple of kThreads * 8. Defined for every n_rows, 0 included (before the fix
// n_rows = 0 divided by zero: SIGFPE, issue 23).
inline int64_t chunk_for(int64_t n_rows, int64_t vocab, int sm_count) {
  const int64_t quantum = static_cast<int64_t>(kThreads) * 8;
  const int64_t want_blocks = static_cast<int64_t>(sm_count > 0 ? sm_count : 132) * kBlocksPerSm;
  int64_t splits = (n_rows <= 0 || n_rows >= want_blocks) ? 1 : (want_blocks + n_rows - 1) / n_rows;
  const int64_t max_splits = (vocab + kMinElementsPerBlock - 1) / kMinElementsPerBlock;
  if (splits > max_splits) splits = max_splits;
  if (splits < 1) splits = 1;
  if (splits > 65535) splits = 65535;
  int64_t chunk = (vocab + splits - 1) / splits;
  chunk = (chunk + quantum - 1) / quantum * quantum;
  return chunk > 0 ? chunk : quantum;
}

// Blocks per row for that chunk.
inline int64_t splits_for(int64_t vocab, int64_t chunk) { return vocab > 0 ? (vocab + chunk - 1) / chunk : 1; }

// What the kernels accept. The logits are only read, so rows may be any distance apart, even overlap (as on the
// CPU); a single row has no row stride at all (torch calls a [1, V] tensor with stride(0) < V contiguous).
inline bool lse_args_valid(const mppo_logits& in) {
  return in.n_rows >= 0 && in.n_rows <= 0x7fffffff && in.vocab > 0 && (in.n_rows <= 1 || in.row_stride >= 0) &&
         in.inv_temperature > 0;
}

// The backward writes the gradient rows concurrently: they must not overlap (a single row always passes).
inline bool lse_grad_rows_valid(const mppo_logits& in, int64_t grad_row_stride) {
  return in.n_rows <= 1 || grad_row_stride >= in.vocab;
}

}  // namespace mppo_cuda
